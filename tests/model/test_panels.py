"""Block weights repacked at load into panels (tl/model/encodings/panels.py, kernels/cpu/quant_ffi.cc
TlQGemmPanels, the plan's weight_layout).

- The layout holds the stored bytes: read back inside the step they are the GGUF's, and a
  looked-up embedding row is the stored one's, for q8_0, q4_0 and q4_1, outputs not a multiple of
  16 and multi-axis outputs.
- The panel kernel gives the stored kernel's results bit for bit, at 1 to 70 rows, on every
  build this CPU runs that has it (AVX-512 VNNI); the others refuse the call (None), and XLA's
  path over panels is XLA's path over the stored blocks exactly.
- The plan packs only where the native kernels read panels on one device, and says why not;
  placement packs every such linear and table but a mixture-of-experts layer's.
- The paged runner over a GGUF file with panels answers as with the stored rows, token for token.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import quantize

from kernels import cpu_build, cpu_native
from tests.helpers.gguf_writer import write_model_gguf
from tests.helpers.models import tiny_config, tiny_tensors
from tests.helpers.runner import ENGINE, runner_greedy
from tl.model.encodings.blocks import BLOCK_ENCODINGS, Blocks
from tl.model.encodings.panels import PANEL_FORMATS, Panels, pack, stored
from tl.model.moe import Experts
from tl.model.weights import Tensor
from tl.runtime.execution import _weight_layout
from tl.runtime.placement import _pack_panels
from tl.runtime.runner import ModelRunner

Q = gguf.GGMLQuantizationType
SHAPES = [((37,), 96), ((6, 2, 16), 576), ((80,), 64)]


def _blocks(fmt: str, out: tuple[int, ...], k: int, seed: int = 0) -> Blocks:
    wf = np.random.default_rng(seed).standard_normal((*out, k)).astype(np.float32)
    return BLOCK_ENCODINGS[fmt](np.asarray(quantize(wf, Q[fmt.upper()])).view(np.uint8), ())


@pytest.mark.parametrize("fmt", PANEL_FORMATS)
@pytest.mark.parametrize(("out", "k"), SHAPES)
def test_panels_hold_the_stored_bytes(fmt: str, out: tuple[int, ...], k: int) -> None:
    b = _blocks(fmt, out, k)
    p = pack(b)
    o = int(np.prod(out))
    assert p.data.shape == (-(-o // 16), k // 32, 16 * b.fmt.block_bytes) and p.out_shape == out and p.n_in == k
    assert p.data.nbytes - b.data.nbytes == (p.data.shape[0] * 16 - o) * b.data.shape[-1]  # padding only
    back = np.asarray(stored(fmt, jnp.asarray(p.data)))
    np.testing.assert_array_equal(back[:o], np.asarray(b.data).reshape(o, -1))
    assert not back[o:].any()
    ids = jnp.asarray([0, o - 1, 3, 17 % o, 0], jnp.int32)
    flat = BLOCK_ENCODINGS[fmt](np.asarray(b.data).reshape(o, -1), ())
    np.testing.assert_array_equal(np.asarray(p.rows(ids)), np.asarray(flat.rows(ids)))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, k)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(Panels.dot)(p, x)), np.asarray(jax.jit(Blocks.dot)(b, x)))


def test_other_formats_are_not_packed() -> None:
    with pytest.raises(ValueError, match="q5_1 weights are not packed"):
        pack(_blocks("q5_1", (16,), 64))


@pytest.mark.parametrize("target", [t.name for t in cpu_build.runnable()])
@pytest.mark.parametrize("fmt", PANEL_FORMATS)
def test_the_panel_kernel_gives_the_stored_kernels_results_bit_for_bit(target: str, fmt: str) -> None:
    lib = cpu_native.library(target)
    call = jax.jit(lambda x, w: w.native(lib, x))
    for out, k in SHAPES:
        b = _blocks(fmt, out, k, seed=k)
        p = pack(b)
        for n in (1, 2, 3, 5, 8, 9, 40, 70):
            x = jnp.asarray(np.random.default_rng(n).standard_normal((n, k)).astype(np.float32))
            if not lib.panels_built():
                assert lib.qgemm_panels(x, jnp.asarray(p.data), fmt) is None
                continue
            want = np.asarray(call(x, b))
            got = np.asarray(call(x, p))
            assert got.shape == (n, *out)
            np.testing.assert_array_equal(got, want, err_msg=f"{target} {fmt} {out} x {k}, {n} rows")


def test_the_plan_packs_only_where_the_native_kernels_read_panels_on_one_device() -> None:
    def decide(
        layout: str = "auto", matmul: str = "cpu_native", built: bool = True, devices: int = 1
    ) -> tuple[str, str]:
        native = SimpleNamespace(panels_built=lambda: built, target=SimpleNamespace(name="x86-64-v3"))
        mesh = SimpleNamespace(devices=np.zeros(devices))
        d = _weight_layout(ENGINE.replace(weight_layout=layout), SimpleNamespace(name=matmul), native, mesh)  # type: ignore[arg-type]
        return d.value, d.reason

    assert decide() == ("panels", "auto: the native kernels read them")
    assert decide("panels") == ("panels", "configured")
    assert decide("stored") == ("stored", "configured")
    assert decide(matmul="xla") == ("stored", "auto: the layer matmuls are XLA's")
    assert decide(built=False) == ("stored", "auto: the x86-64-v3 build has no panel kernels (AVX-512 VNNI)")
    assert decide("panels", devices=2) == ("stored", "panels configured; 2 devices: panels are packed for one")


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])  # q4_0: the kernel test above
def test_the_runner_over_panels_answers_as_over_the_stored_rows(tmp_path: Path, fmt: str) -> None:
    if not cpu_native.library().panels_built():
        pytest.skip(f"the {cpu_build.best().name} build has no panel kernels (AVX-512 VNNI)")
    cfg = tiny_config(tie=True)
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
    types = dict.fromkeys(kinds, Q[fmt.upper()])
    path = write_model_gguf(tmp_path / "tiny.gguf", cfg, tiny_tensors(cfg, seed=7), types)
    answers = []
    for layout in ("panels", "stored"):
        engine = ENGINE.replace(
            model_dir=str(path), matmul_kernel="cpu_native", native_cache_dir="", weight_layout=layout
        )
        runner = ModelRunner.from_model_dir(engine)
        assert runner.plan.weight_layout.value == layout
        kind = Panels if layout == "panels" else Blocks
        assert isinstance(runner.params.layers[0].wqkv, kind) and isinstance(runner.params.embed, kind)
        answers.append(runner_greedy(runner, [3, 14, 15, 92, 65, 35, 89, 79, 32, 38], 8))
    assert answers[0] == answers[1]


def test_placement_packs_the_layers_and_tables_but_not_a_mixture_of_experts() -> None:
    """Expert weights [E, ...] are looked up by expert (tl/model/moe.py `take`): they keep their rows."""
    q = BLOCK_ENCODINGS["q4_1"](np.zeros((4, 16, 40), np.uint8))
    experts = Experts(Tensor(np.zeros((4, 64), np.float32)), q, q, top_k=2, norm_topk_prob=True)
    out = _pack_panels(
        {"experts": experts, "linear": q, "other": BLOCK_ENCODINGS["q5_0"](np.zeros((16, 44), np.uint8))}
    )
    assert isinstance(out["experts"].w_gate_up, Blocks) and isinstance(out["experts"].w_down, Blocks)
    assert isinstance(out["linear"], Panels) and isinstance(out["other"], Blocks)
