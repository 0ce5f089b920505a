"""serve/openapi.py: the OpenAPI 3.1 document is valid (openapi-spec-validator), names every
route the API port serves and nothing else, links POST /v1/responses to the operations its `id`
feeds, and is what GET /openapi.json answers; and the server holds up under schemathesis.

The fuzzed server is the real one: granian serving serve.app:app, tl.entry.build's JAX engine on the
tiny random-weight Llama (tests/helpers/models.py), on loopback. Its cost is kept small: one compiled
step variant (32 tokens x 4 sequences), the reference kernels (no native build or timing at
start-up) and a 64-token context, which bounds every generation whatever max_tokens the
fuzzer draws. schemathesis runs every phase (coverage, fuzzing, and the stateful phase, which
chains POST /v1/responses into GET and DELETE /v1/responses/{id} and into another POST's
previous_response_id by the document's links): seeded, deterministic, 10 examples an
operation, with its server-error, status-code, content-type, response-schema, use-after-free
and negative-data-rejection checks, zero failures, and every link followed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
from openapi_spec_validator import validate

from serve.openapi import document
from serve.routes import ROUTES
from tests.helpers.granian_server import ROOT, free_port, granian_argv, running


def test_the_document_is_valid_and_names_exactly_the_served_routes() -> None:
    doc = document()
    validate(doc)  # type: ignore[arg-type]  # a plain dict is the spec
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {*ROUTES, "/healthz"}
    for path, ops in ROUTES.items():
        assert list(doc["paths"][path]) == [r.method.lower() for r in ops]
        for route in ops:
            op = doc["paths"][path][route.method.lower()]
            assert ("requestBody" in op) == (route.request is not None)
            if route.request is not None:
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref == f"#/components/schemas/{route.request.__name__}"
            assert ("text/event-stream" in op["responses"]["200"]["content"]) == (route.chunk is not None)
    chat = doc["components"]["schemas"]["ChatRequest"]
    assert "messages" in chat["required"] and chat["properties"]["temperature"]["anyOf"][0]["maximum"] == 2.0
    ids = {op["operationId"]: (path, method) for path, ops in doc["paths"].items() for method, op in ops.items()}
    links = doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["links"]
    assert {name: ids[link["operationId"]] for name, link in links.items()} == {
        "GetResponse": ("/v1/responses/{id}", "get"),
        "DeleteResponse": ("/v1/responses/{id}", "delete"),
        "ContinueResponse": ("/v1/responses", "post"),
    }
    assert links["ContinueResponse"]["requestBody"] == {"previous_response_id": "$response.body#/id"}
    named = document("tiny")["components"]["schemas"]
    assert named["ChatRequest"]["properties"]["model"] == {"type": "string", "enum": ["tiny"]}
    assert named["TokenizeRequest"]["properties"]["model"]["anyOf"] == [
        {"type": "string", "enum": ["tiny"]},
        {"type": "null"},
    ]  # tokenize takes no model: null stays allowed, as the server accepts it


ENGINE = """model_id = "tiny"
block_size = 4
num_kv_blocks = 128
max_model_len = 64
max_num_seqs = 4
max_num_batched_tokens = 32
prefill_chunk = 32
token_buckets = [32]
seq_buckets = [4]
max_logprobs = 5
attention_kernel = "reference"
matmul_kernel = "xla"
compile_cache_dir = ""
"""
"""The served engine's [engine] keys (beside the model and the listen addresses): one step
variant, no kernel measurements, and generations bounded by the context."""

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "use_after_free",  # a deleted response is gone
    "negative_data_rejection",  # what the document forbids the server refuses
)

STATEFUL = "[phases.stateful.inference]\nalgorithms = []\n"
"""schemathesis.toml: the stateful phase follows the document's own links only. Its inferred
links (GET /v1/models into GET /v1/models/{id}) would make GET /v1/models its one reliable
starting point, and POST /v1/responses, whose previous_response_id it cannot place, would never
start a scenario."""


def test_schemathesis_finds_nothing_on_the_real_engine(tmp_path: Path, tiny_dir: Path) -> None:
    port, hport = free_port(), free_port()
    cfg = tmp_path / "runtime.toml"
    cfg.write_text(
        f'[engine]\nmodel_dir = "{tiny_dir}"\n{ENGINE}'
        f'http_listen = "127.0.0.1:{port}"\nhealth_listen = "127.0.0.1:{hport}"\n'
    )
    (tmp_path / "schemathesis.toml").write_text(STATEFUL)
    env = {**os.environ, "TL_CONFIG": str(cfg), "PYTHONPATH": str(ROOT)}
    with running(granian_argv(port), env, f"http://127.0.0.1:{hport}/readyz", timeout_s=120):
        served = httpx.get(f"http://127.0.0.1:{port}/openapi.json").json()
        assert served == json.loads(json.dumps(document("tiny")))
        assert served["components"]["schemas"]["ChatRequest"]["properties"]["model"]["enum"] == ["tiny"]
        st = Path(sys.executable).with_name("schemathesis")
        argv = [
            str(st),
            "--config-file",
            str(tmp_path / "schemathesis.toml"),
            "run",
            f"http://127.0.0.1:{port}/openapi.json",
            "--checks",
            ",".join(CHECKS),
            "--max-examples",
            "10",
            "--seed",
            "20261201",
            "--generation-deterministic",
            "--request-timeout",
            "20",
            "--workers",
            "1",  # 2 threads crashed hypothesis in ast.parse on CPython 3.11 ("AST ... recursion depth mismatch")
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert re.search(r"API Links:\s+3 covered / 3 selected", proc.stdout), proc.stdout[-3000:]
    # Every operation it counts was selected and tested, none skipped or errored (schemathesis
    # 4.x counts 13 of the document's 14 operations; which one it leaves out is not established).
    selected = re.search(r"Selected: (\d+)/(\d+)\s+Tested: (\d+)", proc.stdout)
    assert selected and len({int(x) for x in selected.groups()}) == 1, proc.stdout[-3000:]
    assert int(selected.group(1)) >= sum(len(item) for item in served["paths"].values()) - 1
    assert "Skipped:" not in proc.stdout and "Errored:" not in proc.stdout, proc.stdout[-3000:]
