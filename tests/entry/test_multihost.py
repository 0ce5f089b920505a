"""Multi-host as far as one machine allows. Two processes join one jax.distributed job through
tl.runtime.backend.init_distributed (coordinator on localhost, 2 CPU devices each) and see one 4-device
job from which make_mesh builds the tensor-parallel mesh; the keywords come from config, then
the standard JAX_* variables. The step channel (tl/entry/multihost.py): frames round-trip, a silent
peer fails within peer_timeout_s. Groups of 2 and 4 processes (one CPU device each, JAX's CPU
collectives) serve the tiny model over HTTP as one job: greedy answers equal one process's,
concurrent streams equal serial ones, a follower killed mid-stream fails the group (503s, exit
status 3 everywhere), a killed leader takes its followers down, SIGTERM drains then stops them.
A group that does not form (tl/entry/group_start.py): the leader names who has not connected or is
not ready, a lone leader and a lone follower exit within group_start_timeout_s with one line
naming who is missing, and a leader's start-up error makes its granian exit non-zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from bench.multihost_bench import Group, start_group
from tl.core.config import EngineConfig
from tl.entry.multihost import GroupFailed

pytestmark = pytest.mark.serial  # timing bounds: `make test` runs it alone, after the parallel part

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys
from tl.runtime.backend import init_distributed, make_mesh
from tl.core.config import EngineConfig, multihost_group
import jax

cfg = EngineConfig(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
assert init_distributed(multihost_group(cfg, {}), cfg.group_start_timeout_s)
mesh = make_mesh("cpu", 4)
print(jax.process_index(), jax.process_count(), jax.device_count(), jax.local_device_count(),
      sorted({d.process_index for d in mesh.devices.flat}), flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_form_one_job() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, f"127.0.0.1:{port}", str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert sorted(o.split(maxsplit=1)[0] for o, _ in outs) == ["0", "1"]
    for out, _ in outs:
        assert out.split()[1:4] == ["2", "4", "2"] and out.strip().endswith("[0, 1]")


def test_multihost_group_from_config_then_environment() -> None:
    from tl.core.config import Group, multihost_group

    assert multihost_group(EngineConfig(), {}) is None
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    assert multihost_group(EngineConfig(), env) == Group("10.0.0.1:1234", 4, 2)
    assert Group("10.0.0.1:1234", 4, 2).jax_args() == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 2,
    }
    cfg = EngineConfig(coordinator_address="h:1", num_processes=2, process_id=0)
    assert multihost_group(cfg, env) == Group("h:1", 2, 0)
    group = multihost_group(EngineConfig(num_processes=8), {})
    assert group is not None and group.jax_args() == {"num_processes": 8}  # the rest auto-detected


def test_step_frames_round_trip() -> None:
    from tl.runtime.frame import StepFrame

    bufs = (np.arange(7, dtype=np.int32), np.linspace(0, 1, 5, dtype=np.float32))
    pen = (np.array(True), np.ones((2, 3), np.float32), np.zeros((4, 2), np.int32))
    mask = np.full((3, 9), -1, np.int32)
    for frame in (
        StepFrame((8, 1), bufs, None, None, False),
        StepFrame((32, 4), bufs, pen, mask, True),
        StepFrame((16, 4), bufs, (), mask, False),
    ):
        back = StepFrame.decode(frame.encode())
        assert back.variant == frame.variant and back.top == frame.top
        assert len(back.bufs) == len(frame.bufs) and all(
            a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(back.bufs, frame.bufs, strict=True)
        )
        assert (back.penalties is None) == (frame.penalties is None)
        for a, b in zip(back.penalties or (), frame.penalties or (), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        assert (back.mask is None) == (frame.mask is None)
        if frame.mask is not None:
            assert back.mask is not None and np.array_equal(back.mask, frame.mask)


def test_step_address_and_roles() -> None:
    from tl.entry.multihost import is_follower, step_address

    assert step_address("10.0.0.1:8476", 0) == ("10.0.0.1", 8477)
    assert step_address("leader.tl:8476", 9000) == ("leader.tl", 9000)
    assert step_address("[::1]:5000", 0) == ("::1", 5001)
    from tl.core.config import multihost_group

    assert not is_follower(multihost_group(EngineConfig(), {}))
    assert not is_follower(multihost_group(EngineConfig(coordinator_address="h:1", num_processes=2, process_id=0), {}))
    assert is_follower(
        multihost_group(EngineConfig(coordinator_address="h:1", num_processes=2), {"JAX_PROCESS_ID": "1"})
    )
    assert not is_follower(multihost_group(EngineConfig(num_processes=2), {}))  # unknown id: serve refuses it later


def test_a_silent_follower_and_a_lost_leader_fail_within_the_bound() -> None:
    """The channel alone (no jax): a follower that stops beating is lost after peer_timeout_s,
    on_failure runs once with the reason, and the follower then sees its leader gone."""
    from tl.entry.multihost import Follower, Leader

    reasons: list[str] = []
    leader = Leader(1, 0.5, reasons.append, exit_on_failure=False)
    port = leader.listen("127.0.0.1", 0)
    follower = Follower(1, 0.5, exit_on_failure=False)
    follower.connect("127.0.0.1", port, timeout_s=10)
    assert leader.wait_connected(10)
    follower.announce_ready()
    assert leader.wait_ready(10)
    assert leader.all_ready and follower.reachable
    time.sleep(1.0)  # heartbeats both ways keep both alive
    assert leader.failure is None and follower.failure is None
    follower._closed.set()  # the follower's heartbeat stops (as a stalled process's does)
    t0 = time.monotonic()
    while leader.failure is None and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    failed_after = time.monotonic() - t0
    assert leader.failure is not None and "process 1 has been silent" in leader.failure
    # silence counts from the last beat heard (up to beat_s = 0.1 s before the stop), checked every beat_s
    assert 0.5 - 0.1 - 0.05 <= failed_after < 0.5 + 0.1 + 0.5
    # on_failure runs on the monitor thread just after `failure` is set: wait for it, bounded
    t1 = time.monotonic()
    while not reasons and time.monotonic() - t1 < 2:
        time.sleep(0.01)
    assert reasons == [leader.failure]
    with pytest.raises(GroupFailed, match="leader"):
        list(follower.frames())  # the leader closed every connection when it failed


def test_a_step_that_raises_on_the_leader_fails_the_group_naming_the_lost_process() -> None:
    """The channel alone (no jax): a collective broken by a killed follower can raise on the leader
    before its reader has seen the socket close; `broken` waits for that diagnosis (bounded by
    peer_timeout_s), so the reason names the process. With no peer lost, the step's own error
    fails the group once the bound has passed."""
    from tl.entry.multihost import Follower, Leader

    reasons: list[str] = []
    leader = Leader(1, 2.0, reasons.append, exit_on_failure=False)
    port = leader.listen("127.0.0.1", 0)
    follower = Follower(1, 2.0, exit_on_failure=False)
    follower.connect("127.0.0.1", port, timeout_s=10)
    assert leader.wait_connected(10)
    follower.close()  # the follower's process is gone: its socket closes
    t0 = time.monotonic()
    err = leader.broken(RuntimeError("gloo: connection reset by peer"))
    assert isinstance(err, GroupFailed) and "process 1" in str(err), str(err)
    assert time.monotonic() - t0 < 2.0 and reasons == [leader.failure] and str(err) == leader.failure

    reasons.clear()
    alone = Leader(0, 0.3, reasons.append, exit_on_failure=False)
    t0 = time.monotonic()
    err = alone.broken(RuntimeError("bad step"))
    assert time.monotonic() - t0 >= 0.3 and reasons == ["a step failed on process 0: RuntimeError: bad step"]
    assert str(err) == reasons[0]


def test_the_leader_names_the_follower_lost_without_a_word() -> None:
    """The channel alone (no jax): a follower that fails on its own reports why before it closes;
    the leader takes it for a consequence and names a follower that closed without a report (the
    killed one), else, after REPORTED_WAIT_S, the reporter with its reason."""
    from tl.entry.multihost import REPORTED_WAIT_S, Follower, Leader

    def group(n: int) -> tuple[Leader, list[Follower], list[str]]:
        reasons: list[str] = []
        leader = Leader(n, 2.5, reasons.append, exit_on_failure=False)  # checked every beat_s = 0.5 s
        port = leader.listen("127.0.0.1", 0)
        followers = [Follower(i + 1, 2.5, exit_on_failure=False) for i in range(n)]
        for f in followers:
            f.connect("127.0.0.1", port, timeout_s=10)
        assert leader.wait_connected(10)
        return leader, followers, reasons

    leader, (first, second), reasons = group(2)
    first.fail("a step failed on process 1: gloo: connection reset")  # reports, then closes
    time.sleep(0.2)
    assert leader.failure is None  # a reporter's close waits for the cause
    second.close()  # closes without a word
    t0 = time.monotonic()
    while not reasons and time.monotonic() - t0 < 2:
        time.sleep(0.01)
    assert reasons == ["process 2 closed the step channel (it exited or its host went away)"]

    leader, (only,), reasons = group(1)
    only.fail("a step failed on process 1: out of memory")
    t0 = time.monotonic()
    while not reasons and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    # from the close, REPORTED_WAIT_S, seen by the monitor within one beat (0.5 s), and slack for a loaded CPU
    assert REPORTED_WAIT_S <= time.monotonic() - t0 < REPORTED_WAIT_S + 0.5 + 1.0
    assert reasons == ["process 1 failed: a step failed on process 1: out of memory"]


def test_the_start_up_bound_names_the_missing_followers() -> None:
    """The channel alone (no jax): a leader of three knows by process id who has not connected
    and who has not reported ready, and the start-up bound's line says so on expiry."""
    from tl.entry.group_start import start_deadline
    from tl.entry.multihost import Follower, Leader

    leader = Leader(2, 5.0, exit_on_failure=False)
    port = leader.listen("127.0.0.1", 0)
    followers = [Follower(i, 5.0, exit_on_failure=False) for i in (1, 2)]
    try:
        followers[0].connect("127.0.0.1", port, timeout_s=10)
        lines: list[str] = []
        t0 = time.monotonic()
        with start_deadline(0.3, leader.not_connected, on_expiry=lines.append):
            assert not leader.wait_connected(0.6)
        assert 0.6 <= time.monotonic() - t0 < 2.0
        assert lines == ["group start-up: process 2 of 3 did not connect within 0.3 s (group_start_timeout_s)"]
        followers[1].connect("127.0.0.1", port, timeout_s=10)
        assert leader.wait_connected(10)
        assert leader.not_connected().startswith("jax.distributed did not form")
        followers[1].announce_ready()
        t0 = time.monotonic()
        while 2 not in leader.ready and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        assert not leader.wait_ready(0.3) and leader.not_ready() == "process 1 of 3 did not report ready"
        with start_deadline(0.3, leader.not_ready, on_expiry=lines.append):
            followers[0].announce_ready()
            assert leader.wait_ready(10)
        time.sleep(0.5)
        assert len(lines) == 1, lines  # finished within the bound: nothing said
    finally:
        leader.stop()
        for f in followers:
            f.close()


GROUP_ENGINE = """block_size = 4
num_kv_blocks = 96
max_num_seqs = 4
max_num_batched_tokens = 32
token_buckets = [32]
seq_buckets = [4]
prefill_chunk = 0
max_logprobs = 2
compile_cache_dir = ""
matmul_precision = "highest"
attention_kernel = "reference"
matmul_kernel = "xla"
"""


def group(model_dir: Path, tmp: Path, n: int) -> AbstractContextManager[Group]:
    """n processes (one CPU device each) serving the tiny model as one job (bench/multihost_bench.py)."""
    return start_group(
        f'model_dir = "{model_dir}"\npeer_timeout_s = 3.0\ndrain_timeout_s = 20.0\n' + GROUP_ENGINE, tmp, n
    )


PROMPTS = ["The tiny model", "abc", "Once upon a time, in a land far", "0123456789"]


def _body(prompt: str, stream: bool = False, max_tokens: int = 12) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


EXTRA = [  # every optional part of a step frame: penalties, the token bitmask, top-logprobs
    {"prompt": "abc", "presence_penalty": 1.5, "frequency_penalty": 0.5, "logprobs": 2},
    {"prompt": "Pick one: ", "structured_outputs": {"choice": ["red fox", "blue whale", "green frog"]}},
]


def _extra_body(extra: dict[str, Any]) -> dict[str, Any]:
    return {**_body(str(extra["prompt"])), **extra}


def _same_extra(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Texts equal; logprobs within float32 rounding of the reordered sums (a TP=N step adds each
    layer's N partial products in another order: ~1e-6 relative on logits of a few units)."""
    for g, w in zip(got, want, strict=True):
        assert g["text"] == w["text"] and g["finish_reason"] == w["finish_reason"]
        if w.get("logprobs"):
            assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
            np.testing.assert_allclose(g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"], atol=1e-4)
            for a, b in zip(g["logprobs"]["top_logprobs"], w["logprobs"]["top_logprobs"], strict=True):
                assert a.keys() == b.keys()
                np.testing.assert_allclose([a[k] for k in b], list(b.values()), atol=1e-4)


def _reference(model_dir: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The same requests through one process's server (in memory, one device, no group)."""
    from serve.app import App
    from serve.config_load import load_config
    from tests.helpers.asgi_client import call, served

    cfg_path = model_dir.parent / "single.toml"
    cfg_path.write_text(f'[engine]\nmodel_dir = "{model_dir}"\nmodel_id = "tiny"\n' + GROUP_ENGINE)
    cfg = load_config(str(cfg_path))

    async def go() -> tuple[list[str], list[dict[str, Any]]]:
        async with served(App(config=cfg, handle_signals=False, start_health=False)) as app:
            replies = [await call(app, "POST", "/v1/completions", json=_body(p)) for p in PROMPTS]
            extra = [await call(app, "POST", "/v1/completions", json=_extra_body(e)) for e in EXTRA]
            return [r.json()["choices"][0]["text"] for r in replies], [r.json()["choices"][0] for r in extra]

    return asyncio.run(go())


def _complete(client: httpx.Client, url: str, prompt: str) -> str:
    r = client.post(url + "/v1/completions", json=_body(prompt), timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _stream_text(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    text, events = "", []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                events.append(ev)
                if "choices" in ev and ev["choices"]:
                    text += ev["choices"][0].get("text", "")
    return text, events


def test_two_processes_serve_one_model_and_drain_on_sigterm(tiny_dir: Path, tmp_path: Path) -> None:
    """Tensor parallelism across two processes: greedy answers over HTTP equal one process's,
    concurrent streams equal serial answers; SIGTERM to the leader finishes the stream in
    flight, then stops the follower; both exit 0."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model)
    expected, expected_extra = _reference(model)
    with group(model, tmp_path, 2) as g, httpx.Client() as client:
        assert [_complete(client, g.http, p) for p in PROMPTS] == expected
        extra = [client.post(g.http + "/v1/completions", json=_extra_body(e), timeout=60).json() for e in EXTRA]
        _same_extra([r["choices"][0] for r in extra], expected_extra)
        assert extra[1]["choices"][0]["text"] in ("red fox", "blue whale", "green frog")
        with ThreadPoolExecutor(4) as pool:
            streamed = list(pool.map(lambda p: _stream_text(client, g.http, _body(p, True))[0], PROMPTS))
        assert streamed == expected
        models = client.get(g.http + "/v1/models").json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["backend"]["device_count"] == 2
        follower = g.health[1]  # its health port only: ready (joined, compiled, leader reachable), no API
        assert client.get(follower + "/readyz").status_code == 200
        assert client.get(follower + "/v1/models").status_code == 404
        # SIGTERM mid-stream: the stream finishes (its finish reason is length), new requests 503
        long = _body(PROMPTS[2], True, max_tokens=60)
        with client.stream("POST", g.http + "/v1/completions", json=long, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            g.procs[0].send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in [first, *rest[:-1]]]
        assert finishes[-1] == "length" and rest[-1] == "data: [DONE]", rest[-3:]
        assert g.procs[0].wait(60) == 0, g.log(0)
        assert g.procs[1].wait(30) == 0, g.log(1)
        assert "stopped by the leader" in g.log(1) and "steps sent to 1 followers" in g.log(0)


def test_four_processes_then_a_killed_follower_fails_the_group(tiny_dir: Path, tmp_path: Path) -> None:
    """Four processes: greedy answers equal one process's. Then a follower killed mid-stream:
    the stream ends in a 503 engine_unavailable error event, new requests are refused with
    503, and every other process exits with status 3 within the bound (peer_timeout_s 3 s)."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model)
    expected, _ = _reference(model)
    with group(model, tmp_path, 4) as g, httpx.Client() as client:
        assert [_complete(client, g.http, p) for p in PROMPTS] == expected
        events: list[dict[str, Any]] = []
        with client.stream("POST", g.http + "/v1/completions", json=_body(PROMPTS[2], True, 300), timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    t0 = time.monotonic()
                    os.killpg(g.procs[2].pid, signal.SIGKILL)
        assert "choices" in events[0] and "error" in events[-1], events[-2:]
        assert events[-1]["error"]["code"] == "engine_unavailable" and "process 2" in events[-1]["error"]["message"], (
            events[-1],
            g.log(0)[-4000:],
        )
        refused = None
        try:
            refused = client.post(g.http + "/v1/completions", json=_body("x"), timeout=10)
        except httpx.TransportError:
            pass  # already gone: the exit follows the failure within FAILURE_GRACE_S
        if refused is not None:
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        try:  # the leader stops admitting: not ready for the second before it exits
            assert client.get(g.health[0] + "/readyz", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        # followers exit with the group's status 3; the leader's granian reports its worker's
        # unexpected exit (status 3) with its own status 1: non-zero either way, so the group restarts
        assert g.procs[0].wait(30) == 1, g.log(0)
        for i in (1, 3):
            assert g.procs[i].wait(30) == 3, (i, g.log(i))
        assert time.monotonic() - t0 < 3.0 + 10, "the group outlived its bound"
        assert "multi-host group failed" in g.log(0) and "multi-host group failed" in g.log(1)


def test_a_killed_leader_takes_its_follower_down(tiny_dir: Path, tmp_path: Path) -> None:
    """The leader SIGKILLed: its follower notices the closed channel and exits non-zero at once
    (status 3; or JAX's coordination client aborts it first, SIGABRT, when it sees the
    coordinator gone in the same instant). Nothing waits in a collective."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model)
    with group(model, tmp_path, 2) as g:
        os.killpg(g.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = g.procs[1].wait(30)
        assert code in (3, -signal.SIGABRT), (code, g.log(1))
        assert time.monotonic() - t0 < 3.0 + 2, "the follower outlived its bound"
        if code == 3:
            assert "the leader (process 0) closed the step channel" in g.log(1)


def _alone(model_dir: Path, tmp: Path, process_id: int, engine: str) -> tuple[subprocess.Popen[bytes], Path]:
    """One process of a 2-process group started alone by `tl serve` (its own session, one CPU
    device), with `engine` lines added to its config; the process and its log."""
    from bench.soak import free_port

    config, log = tmp / f"alone-{process_id}.toml", tmp / f"alone-{process_id}.log"
    config.write_text(
        f'[engine]\nmodel_dir = "{model_dir}"\ntensor_parallel = 2\nprocess_id = {process_id}\n'
        f'coordinator_address = "127.0.0.1:{free_port()}"\nstep_port = {free_port()}\n'
        f'http_listen = "127.0.0.1:{free_port()}"\nhealth_listen = "127.0.0.1:{free_port()}"\n' + engine + GROUP_ENGINE
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, log


def _wait_alone(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> tuple[int, str]:
    """The exit status and log of a process from _alone; killed (with its session) if it outlives timeout_s."""
    try:
        return proc.wait(timeout_s), log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _seconds_between(text: str, first: str, then: str) -> float:
    """Seconds between the log lines holding `first` and `then` (setup_logging's asctime, ms)."""

    def at(needle: str) -> float:
        line = next(x for x in text.splitlines() if needle in x)
        stamp = time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
        return time.mktime(stamp) + int(line[20:23]) / 1000

    return at(then) - at(first)


BOUND = 3.0
SLACK_S = 40.0  # python, granian and jax imports before the bound starts, on 2 shared cores


def test_a_leader_without_its_follower_exits_naming_it(tiny_dir: Path, tmp_path: Path) -> None:
    """Process 0 of 2, alone: within group_start_timeout_s of opening its step channel it logs one
    ERROR line naming process 1, and exits (status 4 in its granian worker, whose granian then
    exits 1) before jax.distributed's own deadline aborts it."""
    proc, log = _alone(tiny_dir, tmp_path, 0, f"num_processes = 2\ngroup_start_timeout_s = {BOUND}\n")
    code, text = _wait_alone(proc, log, BOUND + SLACK_S)
    assert code == 1, text[-3000:]
    errors = [x for x in text.splitlines() if " ERROR tl.entry.group_start: " in x]
    assert len(errors) == 1, text[-3000:]
    assert errors[0].endswith(
        "group start-up: process 1 of 2 did not connect within 3.0 s (group_start_timeout_s); exiting with status 4"
    )
    assert BOUND <= _seconds_between(text, "step channel listening", "group start-up:") < BOUND + 1.5
    assert "Unexpected exit from worker-1" in text and "Terminating process" not in text  # not JAX's abort


def test_a_follower_without_its_leader_exits_naming_it(tiny_dir: Path, tmp_path: Path) -> None:
    """Process 1 of 2, alone: within group_start_timeout_s of trying the leader's step channel it
    logs one ERROR line naming the leader (process 0) and exits with status 4."""
    proc, log = _alone(tiny_dir, tmp_path, 1, f"group_start_timeout_s = {BOUND}\n")
    code, text = _wait_alone(proc, log, BOUND + SLACK_S)
    assert code == 4, text[-3000:]
    errors = [x for x in text.splitlines() if " ERROR " in x]
    assert len(errors) == 1 and "group start-up: process 1: the leader (process 0) did not answer" in errors[0], text
    assert errors[0].endswith("within 3.0 s (group_start_timeout_s); exiting with status 4")
    assert BOUND <= _seconds_between(text, "connecting to the leader's step channel", "group start-up:") < BOUND + 1.5


def test_a_leader_failing_start_up_under_granian_exits_non_zero(tiny_dir: Path, tmp_path: Path) -> None:
    """An exception in the leader's start-up (here: num_processes unknown, so it cannot name its
    followers) becomes lifespan.startup.failed; granian then exits non-zero instead of serving
    without a lifespan."""
    proc, log = _alone(tiny_dir, tmp_path, 0, "")
    code, text = _wait_alone(proc, log, SLACK_S)
    assert code == 1, text[-3000:]  # granian's status on its worker's exit
    assert "ConfigError: the server of a multi-host job is process 0 and needs" in text, text[-3000:]
    assert "got process_id 0 and num_processes unknown" in text
    assert "ASGI lifespan startup failed" in text and "continuing without Lifespan" not in text


def test_a_follower_whose_health_port_cannot_listen_exits_1(caplog: pytest.LogCaptureFixture) -> None:
    """The port taken: one ERROR line naming the port and the cause, status 1, nothing followed."""
    from serve.follower import follower_main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = EngineConfig(health_listen=f"127.0.0.1:{port}", process_id=1, num_processes=2)
        with caplog.at_level("ERROR", logger="serve.follower"):
            assert follower_main(cfg) == 1
    assert f"health port 127.0.0.1:{port} did not start" in caplog.text, caplog.text
