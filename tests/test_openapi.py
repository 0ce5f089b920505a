"""serve/openapi.py: the OpenAPI 3.1 document is valid (openapi-spec-validator), names every
route the API port serves and nothing else, is what GET /openapi.json answers, and holds up
under schemathesis against a real granian server on the succ engine: seeded, a fixed number of
examples per operation (15), with its server-error, status-code, content-type and response-schema
checks, zero failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from granian_server import ROOT, free_port, granian_argv, running
from openapi_spec_validator import validate

from serve.openapi import document
from serve.routes import ROUTES


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


def test_schemathesis_finds_nothing(tmp_path: Path) -> None:
    port, hport = free_port(), free_port()
    cfg = tmp_path / "runtime.toml"
    cfg.write_text(
        f'[engine]\nmodel_dir = "models/succ"\nblock_size = 4\nhttp_listen = "127.0.0.1:{port}"\n'
        f'health_listen = "127.0.0.1:{hport}"\nqueue_deadline_ms = 2000\n'
    )
    env = {**os.environ, "TL_CONFIG": str(cfg), "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    with running(granian_argv(port, "fake_app:app"), env, f"http://127.0.0.1:{port}/healthz", timeout_s=30):
        served = httpx.get(f"http://127.0.0.1:{port}/openapi.json").json()
        assert served == json.loads(json.dumps(document("succ")))
        assert served["components"]["schemas"]["ChatRequest"]["properties"]["model"]["enum"] == ["succ"]
        st = Path(sys.executable).with_name("schemathesis")
        argv = [
            str(st),
            "run",
            f"http://127.0.0.1:{port}/openapi.json",
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
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
