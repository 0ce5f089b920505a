"""A row's result does not depend on its step (issue 48), bit for bit, on tiny models.

For every served weight encoding (GGUF files of mixed q4_0/q4_1/q5_0/q5_1/q8_0 kinds, of the
K-quants and of F16/BF16, a float32 model, int8 quantized at load) and every kernel path (the
integer kernels of each build this CPU runs, the float ones of the best; XLA's dequantizing dot
beside the native attention), one probe
sequence's logits are compared, bit for bit, between the probe alone and the probe in other
steps: behind another prompt (another place on the token axis, another token bucket), split
in two chunks (its first tokens cached from an earlier step, as a prefix-cache hit leaves
them), and its next token decoded alone and among other decodes (row buckets 1 and 8).

Not covered: the jnp reference attention (kernels/paged_attention.py): XLA's reductions over a
step's keys follow the step's shapes, so it is not batch invariant; the CPU runs the native
kernel, and the README says what is not guaranteed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels import cpu_build
from tests.helpers.gguf_writer import CASES, write_model_gguf
from tests.helpers.models import tiny_tensors
from tl.core.config import EngineConfig
from tl.core.plan import SchedulerOutput, SeqWork
from tl.core.request import SamplingParams
from tl.runtime.runner import ModelRunner

ENGINE = EngineConfig(
    block_size=4,
    num_kv_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    token_buckets=(1, 8, 32, 64),
    seq_buckets=(4,),
    prefill_chunk=0,
    prefix_cache="none",
    max_logprobs=0,
    decode_steps=1,
    compile_cache_dir="",
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
BEST = cpu_build.best().name
RUNNABLE = [t.name for t in cpu_build.runnable()]

# (file case of tests/helpers/gguf_writer.py CASES, weight_dtype): the GGUF's own kinds, and float32 / int8 of one file.
WEIGHTS = {
    "mixed": ("mixed", "auto"),
    "k_quants": ("k_quants", "auto"),
    "halves": ("halves", "auto"),
    "float32": ("mixed", "float32"),
    "int8": ("mixed", "int8"),
}
# Each build's own integer kernels for the block kinds; the float ones on the best build; XLA's dot.
PATHS = [(w, t, "cpu_native") for w in ("mixed", "k_quants") for t in RUNNABLE]
PATHS += [(w, BEST, "cpu_native") for w in ("halves", "float32", "int8")]
PATHS += [("mixed", BEST, "xla")]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    root = tmp_path_factory.mktemp("invariance")
    for case, (make_cfg, types) in CASES.items():
        cfg = make_cfg()
        out[case] = write_model_gguf(root / f"{case}.gguf", cfg, tiny_tensors(cfg, seed=11), types)
    return out


def _work(seq: int, tokens: tuple[int, ...], blocks: tuple[int, ...], start: int = 0) -> SeqWork:
    return SeqWork(seq, tokens, start, blocks, True, GREEDY, 0, 0)


def _logits(runner: ModelRunner, *work: SeqWork) -> np.ndarray:
    return runner.logits(SchedulerOutput(tuple(work)))


@pytest.mark.parametrize("weights,target,matmul", PATHS, ids=[f"{w}-{t}-{m}" for w, t, m in PATHS])
def test_a_rows_logits_do_not_depend_on_its_step(
    files: dict[str, Path], weights: str, target: str, matmul: str
) -> None:
    case, dtype = WEIGHTS[weights]
    cfg = ENGINE.replace(
        model_dir=str(files[case]),
        weight_dtype=dtype,
        native_target=target,
        matmul_kernel=matmul,
        attention_kernel="cpu_native",
    )
    runner = ModelRunner.from_model_dir(cfg)
    assert runner.kernels.native is not None and runner.kernels.native.target.name == target
    assert runner.kernels.matmul.name == matmul
    rng = np.random.default_rng(3)
    vocab = runner.model_config.vocab_size
    probe = tuple(int(t) for t in rng.integers(3, vocab - 3, 21))
    other = tuple(int(t) for t in rng.integers(3, vocab - 3, 13))
    nxt = int(rng.integers(3, vocab - 3))
    table = (0, 1, 2, 3, 4, 5)

    def fresh(k: int) -> tuple[int, ...]:  # a probe sequence's own blocks, never reused
        return tuple(range(6 * k, 6 * k + 6))

    alone = _logits(runner, _work(0, probe, table))[0]  # 21 tokens: bucket 32
    got: dict[str, np.ndarray] = {}
    got["behind a prompt"] = _logits(runner, _work(1, other, fresh(1)), _work(0, probe, fresh(2)))[1]  # 34: 64
    _logits(runner, _work(0, probe[:9], fresh(3)))
    got["split"] = _logits(runner, _work(1, other, fresh(4)), _work(0, probe[9:], fresh(3), 9))[1]
    got["short split"] = _logits(runner, _work(0, probe[9:], fresh(3), 9))[0]  # 12 tokens: bucket 32 again
    for key, value in got.items():
        np.testing.assert_array_equal(value, alone, err_msg=key)

    decode = _logits(runner, _work(0, (nxt,), table, len(probe)))[0]  # bucket 1
    for k in (2, 5):  # other sequences' prompts, then the probe's decode among theirs
        _logits(runner, _work(k, probe[: 4 + k], fresh(k + 4)))
    among = _logits(
        runner,
        _work(2, (7,), fresh(6), 6),
        _work(0, (nxt,), fresh(2), len(probe)),
        _work(5, (9,), fresh(9), 9),
    )[1]  # bucket 8
    np.testing.assert_array_equal(among, decode, err_msg="a decode among others")
