"""Int8 weights (EngineConfig.weight_dtype = "int8") on tiny random models: quantization error
bounds, quality of the int8 forward against float32 (greedy agreement, max logit difference),
and the paged int8 runner against the dense int8 forward (same compiled arithmetic).
The SmolLM2 figures (greedy agreement, max |Δlogit|, speed) come from `python -m bench quant`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.models import tiny_cfg
from tests.helpers.runner import ENGINE, GREEDY, dense_greedy
from tl.core.plan import SchedulerOutput, SeqWork
from tl.model import llama, loader
from tl.model.encodings.int8 import quantize_int8
from tl.model.weights import Int8
from tl.runtime import startup
from tl.runtime.runner import ModelRunner

_dense = jax.jit(llama.forward_dense, static_argnums=1)


def test_quantize_int8_per_output_channel() -> None:
    w = np.random.default_rng(0).standard_normal((24, 40)).astype(np.float32) * np.linspace(0.1, 3, 24)[:, None]
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and q.shape == (24, 40) and scale.shape == (24,)
    assert np.abs(q).max(axis=1).tolist() == [127] * 24  # each row uses the full range
    err = np.abs(q * scale[:, None] - w)
    assert (err <= scale[:, None] / 2 + 1e-7).all()


def test_linear_int8_matches_float_within_quantization_error() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 48)).astype(np.float32) / 8  # [in, out]
    for rows in (1, 3, 16):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        got = np.asarray(llama.linear(jnp.asarray(x), Int8(*quantize_int8(w.T))))
        want = x @ w
        assert got.shape == want.shape and np.abs(got - want).max() <= 0.02 * np.abs(want).max()


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_int8_forward_quality_against_float32(tied: bool, bias: bool) -> None:
    cfg = tiny_cfg(tied=tied, bias=bias)
    host = llama.init_params(cfg, jax.random.key(3))
    f32, i8 = (loader.load_weights(host, cfg, weight_dtype=wd) for wd in ("float32", "int8"))
    ids = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, 48), jnp.int32)
    want, got = np.asarray(_dense(f32, cfg, ids)[1]), np.asarray(_dense(i8, cfg, ids)[1])
    err = np.abs(got - want).max()
    assert err <= 0.1 * np.abs(want).max()
    # Greedy agreement follows from the error: a position's argmax can only move where its
    # float32 top-2 gap is at most twice its largest |dlogit| (checked at every other position;
    # on these random models 45-60% of them).
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * np.abs(got - want).max(axis=-1)
    assert clear.mean() >= 0.25 and (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_int8_runner_paged_matches_dense_int8() -> None:
    engine = ENGINE.replace(weight_dtype="int8")
    cfg = tiny_cfg()
    runner = ModelRunner(startup.start(cfg, llama.init_params(cfg, jax.random.key(5)), engine))
    assert isinstance(runner.params.layers[0].wqkv, Int8) and isinstance(runner.params.embed, Int8)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    want, _ = dense_greedy(runner.params, cfg, prompt, 6)
    ids, out, start = list(prompt), [], 0
    table = tuple(range(8))
    for _ in range(6):
        w = SeqWork(
            seq_id=0,
            token_ids=tuple(ids[start:]),
            start_pos=start,
            block_table=table,
            sample=True,
            params=GREEDY,
            seed=0,
            num_generated=len(out),
        )
        tok = runner.execute(SchedulerOutput((w,))).results[0].token_ids[0]
        start = len(ids)
        ids.append(tok)
        out.append(tok)
    assert out == want
