"""A fixed set of requests recorded off a running server, to show a change leaves the wire alone.

`python -m bench wire --url http://127.0.0.1:8000 --out before.jsonl` sends each request of
REQUESTS in turn (greedy or seeded: each answer is fixed by the model and the request) and writes
one JSON line per request: its name, the HTTP status, and the body's bytes with what differs
between any two runs (ids, timestamps) replaced by placeholders. `--compare before.jsonl` then
also compares this run's lines with that file's and exits 1 naming each request that differs.
Covers chat (plain, streamed, logprobs, seeded sampling, JSON schema, tools), completions,
embeddings, Anthropic's Messages, Responses, the model list and a refused request.
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
REQUESTS: tuple[tuple[str, str, str, dict[str, Any] | None], ...] = (
    ("models", "GET", "/v1/models", None),
    ("chat", "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "temperature": 0}),
    (
        "chat_stream",
        "POST",
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "chat_logprobs",
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    ),
    (
        "chat_seeded",
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 16, "temperature": 0.8, "seed": 7, "n": 2},
    ),
    (
        "chat_schema",
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "A city and its population, as JSON."}],
            "max_tokens": 48,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        },
    ),
    (
        "chat_tools",
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 32,
            "temperature": 0,
            "tools": [TOOL],
        },
    ),
    (
        "completions",
        "POST",
        "/v1/completions",
        {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "logprobs": 2},
    ),
    (
        "completions_stream",
        "POST",
        "/v1/completions",
        {"prompt": ["One, two,", "Once upon a time"], "max_tokens": 8, "temperature": 0, "stream": True},
    ),
    ("embeddings", "POST", "/v1/embeddings", {"input": ["a red apple", "the sky is blue"]}),
    (
        "messages",
        "POST",
        "/v1/messages",
        {"max_tokens": 16, "temperature": 0, "messages": CHAT},
    ),
    ("responses", "POST", "/v1/responses", {"input": "Say hello.", "max_output_tokens": 12, "temperature": 0}),
    ("refused", "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": -1}),
)
_VOLATILE = (
    (
        re.compile(rb'"(id|created|created_at|system_fingerprint|response_id|item_id|call_id)":\s*("[^"]*"|\d+)'),
        rb'"\1":"~"',
    ),
    (re.compile(rb"\b(chatcmpl|cmpl|resp|msg|call|fc|rs)[-_][A-Za-z0-9]+"), rb"\1-~"),
)


def normalized(body: bytes) -> str:
    """The body with its per-run values (ids, timestamps) replaced by "~"."""
    for pattern, repl in _VOLATILE:
        body = pattern.sub(repl, body)
    return body.decode("utf-8", "replace")


def send(url: str, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def record(url: str) -> list[dict[str, Any]]:
    """Every request of REQUESTS sent in turn, each body naming the server's (first) model."""
    model = json.loads(send(url, "GET", "/v1/models", None)[1])["data"][0]["id"]
    out = []
    for name, method, path, body in REQUESTS:
        status, raw = send(url, method, path, None if body is None else {**body, "model": model})
        out.append({"name": name, "status": status, "body": normalized(raw)})
    return out


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench wire", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, required=True, help="where this run's lines go (JSON lines)")
    ap.add_argument("--compare", type=Path, help="an earlier run's file: exit 1 if any request differs")
    args = ap.parse_args(argv)
    lines = record(args.url.rstrip("/"))
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{len(lines)} requests recorded to {args.out}")
    if args.compare is None:
        return 0
    before = {d["name"]: d for d in map(json.loads, args.compare.read_text().splitlines())}
    differ = [line["name"] for line in lines if before.get(line["name"]) != line]
    print("identical" if not differ else f"differ: {', '.join(differ)}")
    return 1 if differ else 0
