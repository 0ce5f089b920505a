"""Tensor-parallel cases, run only by tests/runtime/test_tensor_parallel.py in a subprocess whose
XLA_FLAGS give 8 CPU devices (XLA reads the flag once, before jax starts; the rest of the
suite must keep seeing one device). Not collected by the default run (no test_ prefix).

Greedy output must be token-for-token identical for tensor_parallel N = 1, 2, 4 on the tiny
model (vocab 264 so the vocab splits; 4 heads, 2 KV heads: N=4 replicates KV heads) through
the whole engine (chunked prefill, prefix cache, preemption, speculation), for N = 1 and 3 on
SmolLM2 (9 heads, 3 KV heads; N=2 is refused), and over HTTP.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.differential import Arrival, drive, token_ids
from tests.helpers.engine_cases import BASE_CFG, NarrowKV, check_engine, workload
from tests.helpers.granian_server import ROOT, free_port, granian_argv, running
from tl.core.config import ConfigError, EngineConfig
from tl.core.engine import Engine
from tl.core.request import GenRequest, SamplingParams

jax = pytest.importorskip("jax")
# matmul_precision "highest" throughout: identity across TP degrees is a float32 property (at
# tensor_parallel 1 "high" would run bf16x3 on AMX, under TP XLA's float32 dot).
CFG = BASE_CFG.replace(  # one step variant (32 tokens x 4 sequences): one compile per runner
    token_buckets=(32,),
    seq_buckets=(4,),
    max_logprobs=0,
    compile_cache_dir="",
    speculative="prompt_lookup",
    matmul_precision="highest",
)
VARIANTS = {
    "plain": {"speculative": "none"},
    "everything": {"num_kv_blocks": 14, "prefix_cache": "radix", "prefill_chunk": 4},
}


def test_eight_devices() -> None:
    assert jax.device_count() == 8


def greedy_workload() -> list[Arrival]:
    return [
        Arrival(a.step, dataclasses.replace(a.request, params=dataclasses.replace(a.request.params, temperature=0.0)))
        for a in workload()
    ]


def _engine_outputs(runner: Any) -> dict[str, list[list[int]]]:
    out = {}
    for name, variant in VARIANTS.items():
        cfg = CFG.replace(**variant)
        engine = Engine(NarrowKV(runner, cfg.num_kv_blocks), cfg)  # type: ignore[arg-type]
        out[name] = [token_ids(o) for o in drive(engine, greedy_workload(), check=check_engine)]
        if name == "everything":
            assert engine.stats().preemptions > 0 and engine.stats().prefix_cache_hits > 0
            assert engine.stats().spec_drafts_proposed > 0
    return out


def _shard0(x: Any) -> Any:
    import numpy as np

    return np.asarray(next(s for s in x.addressable_shards if s.device == x.sharding.mesh.devices.flat[0]).data)


def _check_megatron_shards(runner: Any, params: Any, cfg: Any, n: int) -> None:
    """Device 0 holds exactly its Megatron share of layer 0: query heads 0..Hq/N-1 with their KV
    heads (the fused wqkv is grouped by KV head) or, KV replicated, all KV heads; gate and up
    rows 0..F/N-1 (w_gate_up is [F,2,D]); input columns 0..q/N-1 of wo ([D, q]). Step-layout
    matrices are [*out, in], as the Hugging Face tensors `params` are."""
    import numpy as np

    lp = runner.params.layers[0]
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    hq, hk, hd, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    q0 = params[a + "q_proj.weight"][: cfg.q_size // n]
    if hk % n == 0:
        got = _shard0(lp.wqkv.w)  # [Hk/N, G+2, hd, D]
        g = hq // hk
        assert got.shape == (hk // n, g + 2, hd, cfg.hidden_size)
        np.testing.assert_array_equal(got[:, :g].reshape(-1, cfg.hidden_size), q0)
        np.testing.assert_array_equal(
            got[:, g].reshape(-1, cfg.hidden_size), params[a + "k_proj.weight"][: cfg.kv_size // n]
        )
        np.testing.assert_array_equal(
            got[:, g + 1].reshape(-1, cfg.hidden_size), params[a + "v_proj.weight"][: cfg.kv_size // n]
        )
    else:
        assert lp.wqkv is None
        np.testing.assert_array_equal(_shard0(lp.wq.w), q0)
        np.testing.assert_array_equal(_shard0(lp.wk.w), params[a + "k_proj.weight"])  # replicated
    gate_up = _shard0(lp.w_gate_up.w)  # [F/N, 2, D]
    np.testing.assert_array_equal(gate_up[:, 0], params[m + "gate_proj.weight"][: f // n])
    np.testing.assert_array_equal(gate_up[:, 1], params[m + "up_proj.weight"][: f // n])
    np.testing.assert_array_equal(_shard0(lp.wo.w), params[a + "o_proj.weight"][:, : cfg.q_size // n])


def test_tiny_engine_identical_for_tp_1_2_4() -> None:

    from tests.helpers.models import tiny_config
    from tl.model import llama
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start

    cfg = tiny_config(vocab_size=264)
    params = llama.init_params(cfg, jax.random.key(0))
    results = {}
    for n in (1, 2, 4):
        runner = ModelRunner(start(cfg, params, CFG.replace(tensor_parallel=n)))
        b = runner.backend_info
        assert (b.tensor_parallel, b.device_count, b.kv_heads) == (n, n, "replicated" if n == 4 else "sharded")
        assert len(runner.kv_cache[0].sharding.device_set) == n
        _check_megatron_shards(runner, params, cfg, n)
        runner.warmup()
        results[n] = _engine_outputs(runner)
    assert results[1] == results[2] == results[4]
    assert all(len(t) > 0 for t in results[1]["plain"])


def test_tiny_int8_identical_for_tp_1_2_4() -> None:
    """int8 weights: q [*out,in] and scale [*out] are split with their columns; the int32 partial
    sums of the row-parallel dots add up exactly, so greedy output matches N = 1."""

    from tests.helpers.models import tiny_config
    from tl.model import llama
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start

    cfg = tiny_config(vocab_size=264)
    params = llama.init_params(cfg, jax.random.key(1))
    engine_cfg = CFG.replace(weight_dtype="int8", speculative="none")
    results = {}
    for n in (1, 2, 4):
        runner = ModelRunner(start(cfg, params, engine_cfg.replace(tensor_parallel=n)))
        lp = runner.params.layers[0]
        qkv = lp.wqkv if n < 4 else lp.wq
        assert _shard0(qkv.scale).shape[:1] == ((cfg.num_key_value_heads // n,) if n < 4 else (cfg.q_size // n,))
        assert _shard0(lp.w_gate_up.q).shape == (cfg.intermediate_size // n, 2, cfg.hidden_size)
        results[n] = [token_ids(o) for o in drive(Engine(runner, engine_cfg), greedy_workload(), check=check_engine)]
    assert results[1] == results[2] == results[4]
    assert all(len(t) > 0 for t in results[1])


def test_tiny_blocks_identical_for_tp_1_2_4() -> None:
    """q4_1 weights: each output's row of ggml blocks (20 bytes a block of 32 inputs) split by
    out, and row-parallel weights split by input only into whole blocks: w_down's 128 inputs (4
    blocks) over 2 and 4 devices, wo's 64 (2 blocks) over 2; over 4 wo stays whole (XLA gathers
    its input)."""

    from tests.helpers.models import tiny_config
    from tl.model import llama
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start

    cfg = tiny_config(vocab_size=264)
    params = llama.init_params(cfg, jax.random.key(1))
    # The stored rows at every N (one device would repack them into panels: tests/model/test_panels.py).
    engine_cfg = CFG.replace(weight_dtype="q4_1", speculative="none", weight_layout="stored")
    results = {}
    for n in (1, 2, 4):
        runner = ModelRunner(start(cfg, params, engine_cfg.replace(tensor_parallel=n)))
        lp = runner.params.layers[0]
        assert _shard0(lp.w_down.data).shape == (cfg.hidden_size, cfg.intermediate_size // 32 // n * 20)
        assert _shard0(lp.wo.data).shape == (cfg.hidden_size, (cfg.q_size // n if n < 4 else cfg.q_size) // 32 * 20)
        assert _shard0(lp.w_gate_up.data).shape == (cfg.intermediate_size // n, 2, cfg.hidden_size // 32 * 20)
        results[n] = [token_ids(o) for o in drive(Engine(runner, engine_cfg), greedy_workload(), check=check_engine)]
    assert results[1] == results[2] == results[4]
    assert all(len(t) > 0 for t in results[1])


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_tiny_family_identical_for_tp_1_2(family: str) -> None:
    """Gemma 3 (one KV head: replicated at N = 2; q/k norms; sliding layers) and Qwen3-MoE
    (every expert's FFN rows split over the devices, the router whole): greedy output matches N = 1."""

    from tests.helpers.models import family_config, family_tensors
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start

    cfg = dataclasses.replace(family_config(family), vocab_size=264)
    params = family_tensors(cfg)
    engine_cfg = CFG.replace(speculative="none")
    results = {}
    for n in (1, 2):
        runner = ModelRunner(start(cfg, params, engine_cfg.replace(tensor_parallel=n)))
        results[n] = [token_ids(o) for o in drive(Engine(runner, engine_cfg), greedy_workload(), check=check_engine)]
    assert results[1] == results[2]
    assert all(len(t) > 0 for t in results[1])


SMOL = EngineConfig(  # one step variant (64 tokens x 4 sequences): one compile per degree
    block_size=16,
    num_kv_blocks=48,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    token_buckets=(64,),
    seq_buckets=(4,),
    prefill_chunk=32,
    prefix_cache="radix",
    speculative="none",
    max_logprobs=0,
    compile_cache_dir="",
    matmul_precision="highest",
    weight_dtype="float32",  # N = 1 runs the native few-row kernels, N = 3 XLA's: the same float arithmetic
)


def test_smol_identical_for_tp_1_3_and_2_refused(smol_dir: Path) -> None:
    from tl.runtime.runner import ModelRunner
    from tl.text.chat_template import ChatTemplate
    from tl.text.tokenizer import Tokenizer

    smol = smol_dir
    with pytest.raises(ConfigError, match="tensor_parallel=2 does not divide the model's 9 attention heads"):
        ModelRunner.from_model_dir(SMOL.replace(model_dir=str(smol), tensor_parallel=2))
    tok, tpl = Tokenizer.load(smol), ChatTemplate.from_model_dir(smol)
    questions = ["What is the capital of France?", "Name a fruit.", "Count to five."]
    arrivals = [
        Arrival(
            i,
            GenRequest(
                tuple(tok.encode(tpl.render([{"role": "user", "content": q}]))),
                SamplingParams(temperature=0.0, max_tokens=10),
            ),
        )
        for i, q in enumerate(questions)
    ]
    results = {}
    for n in (1, 3):
        cfg = SMOL.replace(model_dir=str(smol), tensor_parallel=n)
        runner = ModelRunner.from_model_dir(cfg)
        assert runner.backend_info.kv_heads == "sharded"
        results[n] = [token_ids(o) for o in drive(Engine(runner, cfg), arrivals, check=check_engine)]
    assert results[1] == results[3]


BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}


def _config(model_dir: Path, tmp: Path, n: int, port: int = 0, hport: int = 0) -> Path:
    cfg = tmp / f"runtime-{n}.toml"
    cfg.write_text(
        f'[engine]\nmodel_dir = "{model_dir}"\nblock_size = 4\nnum_kv_blocks = 64\nmax_num_seqs = 4\n'
        f"max_num_batched_tokens = 32\ntoken_buckets = [32]\nseq_buckets = [4]\n"
        f'compile_cache_dir = ""\nmatmul_precision = "highest"\ntensor_parallel = {n}\n'
        f'http_listen = "127.0.0.1:{port}"\n'
        f'health_listen = "127.0.0.1:{hport}"\n'
    )
    return cfg


def _in_memory_complete(model_dir: Path, tmp: Path, n: int) -> tuple[str, dict[str, Any]]:
    """The completion and /v1/models card of the same server run in this process (no HTTP)."""
    import asyncio

    from serve.app import App
    from serve.config_load import load_config
    from tests.helpers.asgi_client import call, served

    cfg = load_config(str(_config(model_dir, tmp, n)))

    async def go() -> tuple[str, dict[str, Any]]:
        async with served(App(config=cfg, handle_signals=False, start_health=False)) as app:
            r = (await call(app, "POST", "/v1/completions", json=BODY)).json()
            return r["choices"][0]["text"], (await call(app, "GET", "/v1/models")).json()["data"][0]

    return asyncio.run(go())


def _serve_and_complete(model_dir: Path, tmp: Path, n: int) -> tuple[str, dict[str, Any], str]:
    port, hport = free_port(), free_port()
    cfg = _config(model_dir, tmp, n, port, hport)
    env = {**os.environ, "TL_CONFIG": str(cfg), "PYTHONPATH": f"{ROOT}"}
    with running(granian_argv(port), env, f"http://127.0.0.1:{hport}/readyz", timeout_s=120):
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, timeout=60).json()
        metrics = httpx.get(f"http://127.0.0.1:{hport}/metrics").text
        return r["choices"][0]["text"], model, metrics


def test_http_identical_for_tp_1_2(tmp_path: Path) -> None:
    from tests.helpers.models import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "tiny")
    text1, model1 = _in_memory_complete(model_dir, tmp_path, 1)  # one device, in this process
    text2, model2, metrics2 = _serve_and_complete(model_dir, tmp_path, 2)
    assert text1 == text2 and text1
    assert model1["backend"]["tensor_parallel"] == 1 and model2["backend"]["tensor_parallel"] == 2
    assert model2["backend"] == {
        **model2["backend"],
        "platform": "cpu",
        "device_count": 2,
        "dtype": "float32",
        "kv_heads": "sharded",
        "kv_cache_dtype": "float32",
        "matmul_precision": "highest",
        "matmul_kernel": "xla",
    }  # under tensor parallelism XLA partitions its own dot
    # attention: per step shape, the native kernel (per device) where it measured faster than the reference
    assert model2["backend"]["attention_kernel"] in ("cpu_native", "reference", "cpu_native+reference")
    assert "tl_engine_backend_info{" in metrics2 and 'tensor_parallel="2"' in metrics2
