"""The HTTP bench harness (bench/load*.py, roofline, plots, http_bench) without JAX.

A tiny OpenAI-compatible streaming server (asyncio, chunked SSE, fixed tokens with a small
delay) runs on 127.0.0.1 at a free port in a background thread for the end-to-end checks;
everything else is pure: the SSE parser, TTFT/ITL on known timings, percentiles, exact
prompt sizing, the ratio table and the roofline formula.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from bench import http_bench, load
from bench.load import Endpoint, RequestResult, chunk_text, parse_sse, percentile, stream_request, summarize
from bench.load_prompts import PromptFactory, count_tokens, sized_text
from bench.load_tests import CUT, Job, run_closed, run_poisson
from bench.roofline import Machine, fractions, measure_machine, model_cost, roofline_line
from tests.helpers.models import SMOLLM2, byte_tokenizer_json

SMOL_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
SMOL = {k: v for k, v in SMOLLM2.to_dict().items() if k in SMOL_KEYS}  # attention_bias: left to the architecture


class FakeServer:
    """Streams max_tokens deltas 'tok{i} ' (first after first_s, then every gap_s), then usage, [DONE]."""

    def __init__(self, first_s: float = 0.004, gap_s: float = 0.002, port: int = 0) -> None:
        self.first_s, self.gap_s, self.port = first_s, gap_s, port
        self.bodies: list[dict[str, object]] = []
        self.auth: list[str] = []  # Authorization header of each POST
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        self.ready.wait(5)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", self.port))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(hdrs.get("content-length", "0")))
                if method == "POST":
                    self.auth.append(hdrs.get("authorization", ""))
                if method == "GET" and path == "/health":  # llama-server's readiness
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                elif method == "GET" and path == "/v1/models":
                    data = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                        + str(len(data)).encode()
                        + b"\r\n\r\n"
                        + data
                    )
                elif json.loads(body).get("max_tokens") == 0:  # a refusal with a JSON error body
                    data = b'{"error": {"message": "busy", "type": "rate_limit_exceeded"}}'
                    writer.write(
                        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                        b"content-length: " + str(len(data)).encode() + b"\r\n\r\n" + data
                    )
                else:
                    await self._stream(json.loads(body), path, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _stream(self, req: dict[str, object], path: str, writer: asyncio.StreamWriter) -> None:
        self.bodies.append(req)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        chat = path.endswith("chat/completions")

        def send(obj: object) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        n = int(req["max_tokens"])  # type: ignore[call-overload]
        await asyncio.sleep(self.first_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.gap_s)
            choice = {"index": 0, "delta": {"content": f"tok{i} "}} if chat else {"index": 0, "text": f"tok{i} "}
            send({"choices": [choice]})
            await writer.drain()
        if (req.get("stream_options") or {}).get("include_usage"):  # type: ignore[union-attr]
            send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}})
        send(b"[DONE]")
        writer.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bytemodel")
    (d / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))
    (d / "config.json").write_text(
        json.dumps(
            {
                **SMOL,
                "vocab_size": 259,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
            }
        )
    )
    return d


def test_sse_parser() -> None:
    lines = [
        ": keep-alive",
        'data: {"a": 1}',
        "",
        "data:x",
        "data: y",
        "",
        "event: e",
        "",
        "",
        "data: [DONE]\r",
        "",
        "data: tail",
    ]
    assert parse_sse(lines) == ['{"a": 1}', "x\ny", "[DONE]", "tail"]
    assert chunk_text({"choices": [{"text": "hi"}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert chunk_text({"choices": [], "usage": {}}) == ""


def test_ttft_itl_on_known_timings() -> None:
    a = RequestResult(t_start=10.0, chunk_times=[10.1, 10.15, 10.25, 10.3], t_end=10.3)
    b = RequestResult(t_start=10.0, chunk_times=[10.2, 10.4], t_end=10.5, usage_completion_tokens=5)
    bad = RequestResult(t_start=10.0, t_end=10.1, error="HTTP 500")
    assert a.ttft_s == pytest.approx(0.1) and a.itl_s == pytest.approx([0.05, 0.1, 0.05])
    assert a.num_output_tokens == 4 and b.num_output_tokens == 5  # usage wins over delta count
    s = summarize([a, b, bad], wall_s=1.0)
    assert (s["requests"], s["errors"], s["output_tokens"]) == (3, 1, 9)
    assert s["output_tok_s"] == pytest.approx(9.0)
    assert s["ttft_p50_ms"] == pytest.approx(150.0)  # midpoint of 100 and 200
    assert s["itl_p50_ms"] == pytest.approx(np.percentile([50, 100, 50, 200], 50))
    assert s["tpot_mean_ms"] == pytest.approx((200 / 3 + 300 / 4) / 2)


def test_percentile_matches_numpy() -> None:
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def _trained_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = [
        " ".join(random.Random(i).choices("the of and to in water people sound number [] 0123456789".split(), k=50))
        for i in range(200)
    ]
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    return tok


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_prompts_are_sized_exactly(kind: str) -> None:
    tok = Tokenizer.from_str(json.dumps(byte_tokenizer_json())) if kind == "byte" else _trained_bpe()
    pf = PromptFactory(tok, seed=1)
    prompts = [pf.unique(n) for n in (24, 25, 31, 64, 128, 300)]
    assert [count_tokens(tok, p) for p in prompts] == [24, 25, 31, 64, 128, 300]
    assert all(p.startswith("[req ") for p in prompts) and len({p[:20] for p in prompts}) == len(prompts)
    assert count_tokens(tok, pf.shared(200)) == 200
    # A second run's prompts differ from the first's (no prefix-cache hits between runs) unless
    # it replays the first's run id.
    again, replay = PromptFactory(tok, seed=1), PromptFactory(tok, seed=1, run_id=pf.run_id)
    assert again.run_id != pf.run_id and again.unique(24)[:24] != prompts[0][:24]
    assert replay.unique(24) == prompts[0]
    assert count_tokens(tok, sized_text(tok, 40, random.Random(0))) == 40
    with pytest.raises(ValueError):
        sized_text(tok, 2, random.Random(0), head="[a long head of many tokens]")


def test_ratio_table() -> None:
    rows = [
        {"case": "c1", "server": s, **{m: v for m in http_bench.RATIO_METRICS}} for s, v in (("A", 10.0), ("B", 25.0))
    ]
    rows.append({"case": "only-a", "server": "A", **{m: 1.0 for m in http_bench.RATIO_METRICS}})
    ratios = http_bench.ratio_rows(rows)
    assert len(ratios) == len(http_bench.RATIO_METRICS)
    assert all(r["case"] == "c1" and r["B/A"] == pytest.approx(2.5) for r in ratios)
    table = http_bench.ratio_table(ratios)
    assert table[0]["case"] == "c1" and table[0]["A out tok/s"] == 10.0 and table[0]["TTFT p50 ms B/A"] == 2.5
    zero = [{"case": "z", "server": s, **{m: 0.0 for m in http_bench.RATIO_METRICS}} for s in "AB"]
    assert all(math.isnan(r["B/A"]) for r in http_bench.ratio_rows(zero))  # type: ignore[arg-type]


def test_roofline_counts_and_fractions() -> None:
    cost = model_cost(SMOL)
    layer_linears = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    assert cost.num_params == 49152 * 576 + 30 * (layer_linears + 2 * 576) + 576 == 134_515_008
    assert cost.flops_per_token == 2 * (30 * layer_linears + 49152 * 576)
    assert cost.weight_bytes == 4 * cost.num_params
    untied = model_cost({**SMOL, "tie_word_embeddings": False})
    assert untied.num_params == cost.num_params + 49152 * 576 and untied.flops_per_token == cost.flops_per_token
    qwen = model_cost({**SMOL, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.num_params == cost.num_params + 30 * (576 + 2 * 192)
    m = Machine(gemm_flops_per_s=300e9, mem_read_bytes_per_s=30e9, gemm_n=2048, mem_bytes=1, threads=2, repeat=1)
    fr = fractions(m, cost, tokens_per_s=100.0, steps_per_s=20.0)
    assert fr["flop_frac"] == pytest.approx(cost.flops_per_token * 100 / 300e9)
    assert fr["bw_frac"] == pytest.approx(cost.weight_bytes * 20 / 30e9)
    assert "roofline: fp32 GEMM 300.0 GFLOP/s" in roofline_line(m, cost, "smol")
    quick = measure_machine(gemm_n=128, mem_bytes=4 << 20, repeat=5)
    # it runs and gives rates; how high is the machine's business (a busy host read 70 MFLOP/s once)
    assert 0 < quick.gemm_flops_per_s < math.inf and 0 < quick.mem_read_bytes_per_s < math.inf
    assert (quick.gemm_n, quick.mem_bytes, quick.repeat) == (128, 4 << 20, 5)


def test_stream_request_and_body(server: FakeServer) -> None:
    async def go() -> tuple[RequestResult, RequestResult]:
        async with aiohttp.ClientSession() as c:
            comp = Endpoint(server.url, "fake-model", "completions")
            chat = Endpoint(server.url, "fake-model", "chat")
            r1 = await stream_request(
                c,
                comp,
                {
                    "model": "m",
                    "prompt": "x",
                    "max_tokens": 5,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            r2 = await stream_request(
                c, chat, {"model": "m", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "x"}]}
            )
            return r1, r2

    r1, r2 = asyncio.run(go())
    assert r1.ok and r1.usage_completion_tokens == 5 and len(r1.chunk_times) == 5 and r1.usage_prompt_tokens == 7
    assert r2.ok and r2.usage_completion_tokens is None and r2.num_output_tokens == 3
    # The server sleeps 4 ms, then 2 ms between deltas: lower bounds hold however loaded the machine is.
    assert r1.ttft_s is not None and r1.ttft_s >= 0.004 and len(r1.itl_s) == 4
    assert r1.chunk_times[-1] - r1.t_start >= 0.004 + 4 * 0.002


def test_stream_request_records_refusals_and_dead_servers(server: FakeServer) -> None:
    async def go() -> tuple[RequestResult, RequestResult]:
        async with aiohttp.ClientSession() as c:
            refused = await stream_request(c, Endpoint(server.url, "m"), {"model": "m", "prompt": "x", "max_tokens": 0})
            with socket.socket() as sock:  # a port nothing listens on
                sock.bind(("127.0.0.1", 0))
                dead = Endpoint(f"http://127.0.0.1:{sock.getsockname()[1]}", "m")
                gone = await stream_request(c, dead, {"model": "m", "prompt": "x", "max_tokens": 1})
            return refused, gone

    refused, gone = asyncio.run(go())
    assert refused.error.startswith("HTTP 429") and "busy" in refused.error and not refused.chunk_times
    assert gone.error and not gone.ok and gone.t_end >= gone.t_start


def test_lines_split_across_chunks() -> None:
    class Chunks:
        def __init__(self, parts: list[bytes]) -> None:
            self.parts = parts

        async def iter_any(self):  # type: ignore[no-untyped-def]
            for p in self.parts:
                yield p

    async def go(parts: list[bytes]) -> list[str]:
        return [line async for line in load._lines(Chunks(parts))]  # type: ignore[arg-type]

    parts = [b'data: {"a"', b': "\xc3', b'\xa9"}\r\n\r', b"\ndata: [DONE]\n\n", b"tail"]
    assert asyncio.run(go(parts)) == ['data: {"a": "\u00e9"}\r', "\r", "data: [DONE]", "", "tail"]


def test_deadline_cuts_and_poisson(server: FakeServer) -> None:
    ep = Endpoint(server.url, "fake-model")

    async def go() -> tuple[list[RequestResult], float, list[RequestResult], float]:
        async with aiohttp.ClientSession() as c:
            cut, wall = await run_closed(c, ep, [Job("p", 1000)] * 3, concurrency=2, max_seconds=0.3)
            jobs = [Job("p", 2)] * 200
            pois, pwall = await run_poisson(c, ep, jobs, rate=100.0, seed=0, max_seconds=0.3)
            return cut, wall, pois, pwall

    cut, wall, pois, pwall = asyncio.run(go())
    assert len(cut) == 2 and all(r.error == CUT and r.chunk_times for r in cut) and wall < 1.0
    assert 10 <= len(pois) <= 60 and pwall < 1.0  # ~30 arrivals expected in 0.3 s at 100/s


def test_http_bench_end_to_end(
    server: FakeServer, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = [
        "--url",
        server.url,
        "--compare",
        server.url,
        "--tests",
        "prefill,decode,sweep,shared,poisson",
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
        "--levels",
        "1,4",
        "--rate",
        "50",
        "--repeats",
        "2",
        "--max-seconds",
        "5",
        "--seed",
        "7",
        "--roofline-gemm-n",
        "128",
        "--roofline-mem-mib",
        "4",
        "--prefill-tokens",
        "64",
        "--decode-tokens",
        "8",
        "--sweep-prompt-tokens",
        "32",
        "--sweep-output-tokens",
        "4",
        "--shared-prefix-tokens",
        "96",
        "--shared-output-tokens",
        "2",
        "--shared-requests",
        "4",
        "--poisson-requests",
        "6",
        "--prefill-requests",
        "2",
    ]
    assert http_bench.run(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("config: ") and '"seed": 7' in printed and "roofline: fp32 GEMM" in printed
    assert "; int8 " in printed  # the int8 ceiling beside the memory and GEMM ones (bench/int8_peak.py)
    kinds = [json.loads(ln)["kind"] for ln in (out / "results.jsonl").read_text().splitlines()]
    assert kinds[:2] == ["config", "roofline"] and {"request", "summary", "ratio"} <= set(kinds)
    summaries = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines() if '"summary"' in ln]
    assert len(summaries) == 2 * 7 and all(s["errors"] == 0 for s in summaries)
    decode = [s for s in summaries if s["test"] == "decode"]
    assert decode and all(s["requests"] == 2 * 2 and s["output_tokens"] == 4 * 8 for s in decode)
    for s in summaries:  # out % GEMM: the same FLOP rate, counted on output tokens instead of work tokens
        assert s["pct_gemm_out"] == pytest.approx(s["pct_gemm"] * s["output_tok_s"] / s["work_tok_s"])
    report = (out / "report.md").read_text()
    assert "| case | server |" in report and "B/A" in report and "% GEMM" in report and "out % GEMM" in report
    for name in ("throughput_vs_concurrency", "latency_cdf_sweep", "latency_cdf_prefill"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sent = server.bodies[-1]
    assert sent["stream"] is True and sent["ignore_eos"] is True and sent["model"] == "fake-model"
    sized = [b for b in server.bodies if b.get("max_tokens") == 1]  # the prefill prompts
    assert sized and all(len(str(b["prompt"]).encode()) == 64 for b in sized)  # byte tokenizer: 1 byte = 1 token


def test_http_bench_chat_api(server: FakeServer, model_dir: Path, tmp_path: Path) -> None:
    argv = [
        "--url",
        server.url,
        "--api",
        "chat",
        "--tests",
        "shared",
        "--model",
        "m",
        "--model-dir",
        str(model_dir),
        "--out",
        str(tmp_path),
        "--no-plots",
        "--roofline-gemm-n",
        "64",
        "--roofline-mem-mib",
        "1",
        "--shared-prefix-tokens",
        "64",
        "--shared-requests",
        "2",
        "--shared-output-tokens",
        "2",
        "--no-ignore-eos",
        "--api-key",
        "sekrit",
        "--warmup",
        "0",
    ]
    before, before_auth = len(server.bodies), len(server.auth)
    assert http_bench.run(argv) == 0
    sent = server.bodies[before:]
    assert len(sent) == 4 and all("ignore_eos" not in b and b["model"] == "m" for b in sent)
    roles = [[m["role"] for m in b["messages"]] for b in sent]  # type: ignore[union-attr]
    assert roles == [["system", "user"]] * 4
    systems = [b["messages"][0]["content"] for b in sent]  # type: ignore[index]
    assert systems[0] == systems[1] and systems[2] != systems[3]  # shared, then unique prefixes
    assert not list(tmp_path.glob("*.png")) and "sekrit" not in (tmp_path / "report.md").read_text()
    assert server.auth[before_auth:] == ["Bearer sekrit"] * 4


STAND_IN = """
import sys, time
sys.path.insert(0, {root!r})
from tests.bench.test_bench_harness import FakeServer
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
time.sleep(0.3)  # not ready at once: the bench waits for /health
server = FakeServer(port=int(args[args.index("--port") + 1]))
time.sleep(600)
"""


def test_http_bench_starts_the_peer_at_its_best_setting_for_each_case(
    server: FakeServer, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--peer: the stand-in llama-server started once a slot count (1 for prefill and one stream,
    N for an N-stream sweep), on the --gguf file, warmed up, stopped at the end; the roofline's
    counts from the GGUF's tensors."""
    import subprocess
    import sys

    import gguf

    log = tmp_path / "argv.log"
    exe = tmp_path / "llama-server"
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN.format(root=str(Path(__file__).resolve().parents[2]), log=str(log)))
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(0o755)
    model = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    w.add_tensor("token_embd.weight", np.ones((10, 4), np.float32))
    w.add_tensor("output_norm.weight", np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out"
    argv = ["--url", server.url, "--peer", str(exe), "--gguf", str(model), "--peer-threads", "3"]
    argv += ["--tests", "prefill,decode,sweep", "--levels", "1,4", "--model-dir", str(model_dir), "--out", str(out)]
    argv += ["--max-seconds", "5", "--roofline-gemm-n", "128", "--roofline-mem-mib", "4", "--no-plots"]
    argv += [
        "--prefill-tokens",
        "64",
        "--decode-tokens",
        "4",
        "--sweep-prompt-tokens",
        "32",
        "--sweep-output-tokens",
        "2",
    ]
    warmed = len([b for b in server.bodies if b.get("max_tokens") == 8])
    assert http_bench.run(argv) == 0
    printed = capsys.readouterr().out
    starts = [line.split() for line in log.read_text().splitlines()]
    assert [a[a.index("-np") + 1] for a in starts] == ["1", "4"]  # prefill, decode, c=1 on one; c=4 on four
    assert all(a[a.index("-m") + 1] == str(model) and a[a.index("-t") + 1] == "3" for a in starts)
    assert [a[a.index("-c") + 1] for a in starts] == ["4096", str(4 * 4096)]
    assert printed.count("peer: ") == 2
    assert "tiny.gguf: 0.0 M params, 0.0 MB weights at 4 B/param" in printed  # float32 tensors, as stored
    assert len([b for b in server.bodies if b.get("max_tokens") == 8]) - warmed == 4  # A warmed before each case
    assert (out / "peer-1.log").exists() and (out / "peer-4.log").exists()
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split()
    assert not left, "the peer was not stopped"
    ratios = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines() if '"ratio"' in ln]
    assert len({r["case"] for r in ratios}) == 4  # B / A for every case, B the peer


def test_the_int8_ceiling_is_measured_on_every_core_from_registers() -> None:
    """bench/int8_peak.py on this CPU's native build: a positive rate naming the instruction
    (vpdpbusd on AVX-512 VNNI builds, vpmaddubsw + vpaddw on AVX2 ones); None elsewhere."""
    from bench import int8_peak
    from kernels import cpu_build

    peak = int8_peak.measure(threads=1, iters=200_000)
    best = cpu_build.best()
    if best.arch != "x86_64" or best.rank < 1:
        assert peak is None and "not measured" in int8_peak.describe(peak)
        return
    assert peak is not None and peak[0] > 1e9
    assert peak[1] == ("vpdpbusd zmm" if best.rank >= 3 else "vpmaddubsw + vpaddw ymm")
    assert int8_peak.describe(peak, 1).startswith("int8 ") and "1 threads" in int8_peak.describe(peak, 1)


@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4", "x86-64-v4-vnni", "sapphirerapids"])
def test_the_int8_ceiling_compiles_for_every_x86_target(target: str, tmp_path: Path) -> None:
    """bench/int8_peak.cc's two loops (vpdpbusd, vpmaddubsw) compile warning-free for every x86
    SIMD target, whichever this CPU runs."""
    import subprocess

    from kernels import cpu_build

    t = cpu_build.BY_NAME[target]
    try:
        cxx = cpu_build.compiler(t)
    except cpu_build.NativeUnavailable as e:
        pytest.skip(str(e))
    src = Path(__file__).resolve().parents[2] / "bench" / "int8_peak.cc"
    cmd = [cxx, "-O2", "-Wall", "-Wextra", "-Werror", f"-march={t.march}", *t.extra, "-c", str(src)]
    res = subprocess.run([*cmd, "-o", str(tmp_path / "p.o")], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_http_bench_peer_errors_are_one_line(
    server: FakeServer, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing --gguf, and a peer that exits before it is ready: exit 2, one line naming the file
    or the command and its log, nothing left running."""
    base = ["--url", server.url, "--tests", "decode", "--model-dir", str(model_dir), "--out", str(tmp_path / "o")]
    base += ["--roofline-gemm-n", "64", "--roofline-mem-mib", "1", "--no-plots", "--decode-tokens", "2"]
    assert http_bench.run([*base, "--peer", "/bin/false", "--gguf", str(tmp_path / "none.gguf")]) == 2
    assert "--gguf " + str(tmp_path / "none.gguf") + ": no such file" in capsys.readouterr().err
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert http_bench.run([*base, "--peer", "/bin/false", "--gguf", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the peer exited with status 1 before it was ready" in err[0] and "peer-1.log" in err[0]
