# One obvious entry point per habit. `make serve` and `make test` work on a fresh machine
# with Python >= 3.11 and pip: they create .venv, install tl into it and fetch the model.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
MODEL  := artifacts/models/smol-135m/model.gguf  # tl pull adds it to a directory pulled before it was kept

.PHONY: setup model serve generate test bench check cross browser

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

# The native kernels' tests compile every target, aarch64 with Debian's cross compiler: installed
# here where apt-get can (as root); elsewhere that one test says how and skips.
CROSS := /usr/bin/aarch64-linux-gnu-g++

$(CROSS):
	@if [ "$$(uname -m)" = x86_64 ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q g++-aarch64-linux-gnu >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q g++-aarch64-linux-gnu >/dev/null 2>&1) || \
	  echo "could not install g++-aarch64-linux-gnu: the aarch64 compile test will skip"; \
	fi

cross: | $(CROSS)

# The chat page's test (tests/serve/test_chat_page.py) drives a headless Chromium through Playwright:
# Debian's package, installed here where apt-get can (as root); elsewhere that test says how and skips.
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q chromium >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) || \
	  echo "could not install chromium: the chat page test will skip"; \
	fi

browser: | $(CHROMIUM)

# Lint, format and types (config in pyproject.toml; the C++ format in .clang-format): part of `make test`.
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/clang-format --dry-run -Werror kernels/cpu/*.cc kernels/cpu/*.h bench/*.cc

# The suite on the machine's cores (pytest-xdist, at most 4 workers: each loads JAX and models;
# tests handed out one by one: a file per worker left one worker on the largest files, 710 s
# against 493 s on 2 cores), then the tests that assert wall-clock bounds (marked serial) alone,
# with no other worker competing for the cores.
test: $(STAMP) $(MODEL) check | $(CROSS) $(CHROMIUM)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 -m "not serial"
	$(BIN)/python -m pytest -q -m serial

bench: $(STAMP) $(MODEL)
	$(BIN)/python -m bench runner
