"""Pallas paged-attention kernels (kernels/pallas_gpu.py, kernels/pallas_tpu.py) vs the jnp reference.

On CPU in Pallas interpret mode (natively on a GPU), small shapes: non-contiguous block tables, a batch mixing a
fresh prefill chunk, decodes, chunks over cached prefixes, mixed lengths, padding tokens and an
empty padding sequence; float32 and uint16-stored bf16 caches; sliding windows (the TPU kernel's
own; the GPU kernel refuses them). Also the selection rules of kernels/select.py (a model's
windows in the trial trace) and one runner step with the GPU kernel inside the compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import pallas_gpu, pallas_tpu, select
from kernels.paged_attention import AttnArgs
from tests.helpers.attention_cases import MIXED, build_case, inputs, run

NOT_GPU = jax.default_backend() != "gpu"  # on a GPU (bench/gpu_check.sh) the kernel runs natively
CASES = {
    "mixed": (MIXED, 3),
    "decodes": ([(3, 1), (17, 1), (0, 1), (30, 1)], 0),
    "prefill": ([(0, 9), (0, 2)], 5),
    "padded_seq": ([(6, 2), (0, 0)], 2),
}


def _real(c: dict, x: np.ndarray) -> np.ndarray:
    return x[c["seq_idx"] >= 0]


def _assert_matches_reference(
    case: str, bf16: bool, kernel: Callable[..., jax.Array], window: int = 0, **shape: int
) -> np.ndarray:
    """Run `kernel` on one of CASES (`shape`: build_case's bs/hd) with a sliding `window` (0: none);
    its real rows must match the reference's. Returns its output's padding rows."""
    seqs, pad = CASES[case]
    c = build_case(np.random.default_rng(len(case)), seqs, pad, **shape)
    out = np.asarray(kernel(inputs(c, bf16=bf16, window=window)))
    # On an NVIDIA GPU float32 dots run as TF32 by default, in the Triton kernel and in the XLA
    # reference alike (bench/gpu_check.sh saw differences up to 9e-4): a TF32 tolerance there.
    tol = 2e-2 if bf16 else 2e-5 if NOT_GPU else 3e-3
    want = run(c, chunk_blocks=2, bf16=bf16, window=window)
    np.testing.assert_allclose(_real(c, out), _real(c, want), atol=tol, rtol=tol)
    return out[c["seq_idx"] < 0]


BOTH_DTYPES = pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])


@BOTH_DTYPES
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_kernel_matches_reference(case: str, bf16: bool) -> None:
    """At the smallest shapes the compiled kernel takes: head_dim 16, two 8-token pages a block."""
    _assert_matches_reference(
        case, bf16, jax.jit(lambda a: pallas_gpu.paged_attention(a, interpret=NOT_GPU)), bs=8, hd=16
    )


def test_gpu_kernel_refuses_shapes_triton_cannot_take() -> None:
    """head_dim 8, or 4-key compute blocks: refused when compiled (interpret mode takes any shape)."""
    for shape, msg in (({"bs": 8, "hd": 8}, "head_dim 8"), ({"bs": 4, "hd": 16}, r"1 page\(s\) of 4 tokens")):
        probe = _probe(build_case(np.random.default_rng(0), MIXED, 3, **shape))
        with pytest.raises(ValueError, match=msg):
            jax.eval_shape(lambda a: pallas_gpu.paged_attention(a, interpret=False), probe)
        jax.eval_shape(lambda a: pallas_gpu.paged_attention(a, interpret=True), probe)


@BOTH_DTYPES
@pytest.mark.parametrize("case", sorted(CASES))
def test_tpu_adaptation_matches_reference(case: str, bf16: bool) -> None:
    """Our inputs -> the ragged kernel's inputs, checked with jax's own reference in the kernel's place."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    padding_rows = _assert_matches_reference(
        case, bf16, lambda a: pallas_tpu.paged_attention(a, impl=kernel.ref_ragged_paged_attention)
    )
    assert not padding_rows.any()


@pytest.mark.parametrize("case,window", [("mixed", 3), ("mixed", 6)])
def test_tpu_adaptation_with_a_sliding_window_matches_reference(case: str, window: int) -> None:
    """Our window is the kernel's sliding_window (checked with jax's reference in its place)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    impl = kernel.ref_ragged_paged_attention
    _assert_matches_reference(case, False, lambda a: pallas_tpu.paged_attention(a, impl=impl), window=window)


def test_gpu_kernel_refuses_a_sliding_window_and_selection_falls_back() -> None:
    """jax's GPU kernel reads keys from position 0: window > 0 is refused at trace time, in
    interpret mode too, and a model with windows gets the reference from the trial trace."""
    from tl.runtime.backend import make_mesh

    probe = _probe(build_case(np.random.default_rng(0), MIXED, 3, bs=8, hd=16))
    windowed = probe._replace(meta=dataclasses.replace(probe.meta, window=4))
    for interpret in (False, True):
        with pytest.raises(ValueError, match="no sliding window"):
            jax.eval_shape(lambda a, i=interpret: pallas_gpu.paged_attention(a, interpret=i), windowed)
    mesh = make_mesh("cpu", 1)
    assert select.select("auto", "gpu", mesh, True, probe).name == "pallas_gpu"
    fell = select.select("auto", "gpu", mesh, True, probe, windows=(4,))
    assert fell.name == "reference" and "window 4" in fell.reason


@pytest.mark.xfail(
    raises=Exception,
    strict=True,
    reason="jax 0.10.2's Pallas TPU interpreter has no ReshapeTransform (the kernel's "
    "`wait().reshape`); flips to XPASS when jax supports it",
)
def test_tpu_kernel_in_interpret_mode() -> None:
    seqs, pad = CASES["mixed"]
    c = build_case(np.random.default_rng(5), seqs, pad)
    ref = run(c, chunk_blocks=2)
    out = pallas_tpu.paged_attention(inputs(c), interpret=True)
    np.testing.assert_allclose(_real(c, np.asarray(out)), _real(c, ref), atol=2e-5, rtol=2e-5)


def _probe(c: dict) -> AttnArgs:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), inputs(c))


def test_selection_rules() -> None:
    from tl.runtime.backend import make_mesh

    c = build_case(np.random.default_rng(0), MIXED, 3)
    mesh, probe = make_mesh("cpu", 1), _probe(c)
    native, why = select.native_library("cpu", "auto")
    assert select.select("auto", "cpu", mesh, True, probe, native, why).name == (
        "cpu_native" if native else "reference"
    )
    assert select.select("pallas_gpu", "cpu", mesh, True, probe).name == "pallas_gpu (interpret)"
    gpu_probe = _probe(build_case(np.random.default_rng(0), MIXED, 3, bs=8, hd=16))
    assert select.select("auto", "gpu", mesh, True, gpu_probe).name == "pallas_gpu"
    small = select.select("auto", "gpu", mesh, True, probe)  # head_dim 8: Triton's dots cannot take it
    assert small.name == "reference" and "head_dim >= 16" in small.reason
    assert select.select("reference", "gpu", mesh, True, probe).reason == "configured"


def test_runner_step_with_gpu_kernel(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    """Greedy steps through the compiled program: the interpreted GPU kernel == the reference."""
    from tl.core.config import EngineConfig
    from tl.core.plan import SchedulerOutput, SeqWork
    from tl.core.request import SamplingParams
    from tl.runtime.runner import ModelRunner

    base = EngineConfig(
        model_dir=str(tiny_dir),
        num_kv_blocks=32,
        block_size=4,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(32,),
        seq_buckets=(4,),
        compile_cache_dir="",
    )
    outs = []
    for kernel in ("reference", "pallas_gpu"):
        runner = ModelRunner.from_model_dir(base.replace(attention_kernel=kernel))
        assert runner.kernels.attention.name.startswith(kernel)
        tables = ((5, 2, 9, 11), (7, 3, 1, 0))
        prompts = ([1, 2, 3, 4, 5, 6, 7], [9, 8, 7])
        seqs = [list(p) for p in prompts]
        for step in range(4):
            work = tuple(
                SeqWork(
                    seq_id=i,
                    token_ids=tuple(s if step == 0 else s[-1:]),
                    start_pos=0 if step == 0 else len(s) - 1,
                    block_table=tables[i],
                    sample=True,
                    params=SamplingParams(temperature=0.0),
                    seed=0,
                    num_generated=step,
                )
                for i, s in enumerate(seqs)
            )
            res = runner.execute(SchedulerOutput(work=work))
            for i, r in enumerate(res.results):
                seqs[i].append(r.token_ids[0])
        outs.append(seqs)
    assert outs[0] == outs[1]
