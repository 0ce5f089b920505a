"""The OpenAPI 3.1 document of the API port, generated from the route table and the wire Structs.

Owns: `document()`, served at GET /openapi.json: every route of serve/routes.py's ROUTES plus
/healthz, each operation's request body and 200 document as JSON Schema made by msgspec from
the very Structs the server decodes and encodes (never written by hand), `text/event-stream`
where a request may stream, the error statuses the server answers in OpenAI's shape
(serve/errors.py's ErrorDoc), and the links from a created response to the operations its id
feeds (GET, DELETE, previous_response_id). Tested by tests/serve/test_openapi.py (openapi-spec-validator,
the route set, the links, and schemathesis against the real server on a tiny model).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from serve.errors import AnthropicErrorDoc, ErrorDoc
from serve.routes import ROUTES, Route

ERRORS = {
    "400": "Invalid request (the error's `param` names the field)",
    "401": "Missing or wrong API key (when api_keys is set)",
    "404": "Unknown model or route",
    "405": "Wrong method",
    "413": "Body over max_body_bytes",
    "422": "A parameter tl does not serve",
    "429": "Admission queue full",
    "500": "Internal error",
    "503": "No capacity, draining, or aborted",
}
"""Statuses every operation may answer, each with an ErrorDoc body."""


class Health(msgspec.Struct, frozen=True):
    status: str


def _operation_id(method: str, path: str) -> str:
    parts = [p.strip("{}") for p in path.strip("/").replace(".", "_").split("/") if p and p != "v1"]
    return "_".join([method.lower(), *parts])


def _operation(path: str, r: Route, ref: dict[type, Any]) -> dict[str, Any]:
    error = ref[AnthropicErrorDoc if r.anthropic else ErrorDoc]
    ok: dict[str, Any] = {"application/json": {"schema": ref[r.response]}}
    if r.chunk is not None:  # the events: each `data` a chunk document (or an error), the last `[DONE]`
        data = {
            "anyOf": [
                {"const": "[DONE]"},
                {"contentMediaType": "application/json", "contentSchema": {"anyOf": [ref[r.chunk], error]}},
            ]
        }
        event = {"type": "object", "properties": {"data": data}, "description": "One Server-Sent Event"}
        ok["text/event-stream"] = {"schema": event}  # the schema of one event, as schemathesis reads SSE
    op: dict[str, Any] = {
        "operationId": _operation_id(r.method, path),
        "summary": r.summary,
        "responses": {"200": {"description": r.summary, "content": ok}}
        | {
            code: {"description": why, "content": {"application/json": {"schema": error}}}
            for code, why in ERRORS.items()
        },
    }
    if r.request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[r.request]}}}
    params = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
    return op


def _links() -> dict[str, Any]:
    """The links of POST /v1/responses's 200: its `id` names the stored response to GET or DELETE
    and the one another POST continues (`previous_response_id`). Clients may follow them, and
    schemathesis's stateful phase chains these calls by them."""
    rid = "$response.body#/id"
    one = "/v1/responses/{id}"
    return {
        "GetResponse": {"operationId": _operation_id("GET", one), "parameters": {"path.id": rid}},
        "DeleteResponse": {"operationId": _operation_id("DELETE", one), "parameters": {"path.id": rid}},
        "ContinueResponse": {
            "operationId": _operation_id("POST", "/v1/responses"),
            "requestBody": {"previous_response_id": rid},
        },
    }


def _served(model: dict[str, Any], model_id: str) -> dict[str, Any]:
    """A `model` property narrowed to the served id; where it may be null (tokenize and
    detokenize take no model), null stays allowed: the server accepts it."""
    named = {"type": "string", "enum": [model_id]}
    return {**model, "anyOf": [named, {"type": "null"}]} if {"type": "null"} in model.get("anyOf", []) else named


@cache
def document(model_id: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document (built once per model id: the routes and Structs are fixed).
    With the served model's id, every request's `model` and the model path parameter name it
    (an `enum`), so a client generating requests from the document reaches the model."""
    health = Route("GET", ROUTES["/v1/models"][0].handler, None, Health, "Liveness")
    routes = {**ROUTES, "/healthz": (health,)}
    types = sorted(
        {
            t
            for ops in routes.values()
            for r in ops
            for t in (r.request, r.response, r.chunk)
            if t is not None and t is not dict
        }
        | {ErrorDoc, AnthropicErrorDoc},
        key=lambda t: t.__name__,
    )
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    ref: dict[type, Any] = dict(zip(types, schemas, strict=True))
    ref[dict] = {"type": "object", "description": "An OpenAPI 3.1 document"}
    paths: dict[str, Any] = {}
    for path, ops in routes.items():
        for r in ops:
            paths.setdefault(path, {})[r.method.lower()] = _operation(path, r, ref)
    paths["/v1/responses"]["post"]["responses"]["200"]["links"] = _links()
    if model_id is not None:
        for schema in components.values():
            if "model" in schema.get("properties", {}):
                schema["properties"]["model"] = _served(schema["properties"]["model"], model_id)
        paths["/v1/models/{id}"]["get"]["parameters"][0]["schema"] = {"type": "string", "enum": [model_id]}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tl", "version": "1", "description": "An OpenAI-compatible LLM server"},
        "paths": paths,
        "components": {"schemas": components},
    }
