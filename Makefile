# One obvious entry point per habit. `make serve` and `make test` work on a fresh machine
# with Python >= 3.11 and pip: they create .venv, install tl into it and fetch the model.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
MODEL  := artifacts/models/smol-135m/config.json

.PHONY: setup model serve generate test bench check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

setup: $(STAMP)

$(MODEL): | $(STAMP)
	$(BIN)/tl pull smol-135m

model: $(MODEL)

serve: $(STAMP) $(MODEL)
	$(BIN)/tl serve --config configs/runtime.toml

generate: $(STAMP) $(MODEL)
	$(BIN)/tl generate --chat --prompt "What is the capital of France?" --max-tokens 64

test: $(STAMP) $(MODEL)
	$(BIN)/python -m pytest -q

bench: $(STAMP) $(MODEL)
	$(BIN)/python -m bench runner
