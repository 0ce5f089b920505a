"""The model families (Llama 3, Mistral, Qwen3, Qwen3-MoE, Gemma 3) against transformers.

tests/golden/families/<family>.npz holds transformers' float32 logits (torch, eager attention)
for the tiny random-weight model of each family that tests/helpers/models.py builds, over 72 fixed
tokens: bench/families_reference.py wrote them, and shares no code with tl. Here tl loads the
same directory and must give the same logits within float32's rounding; each family-specific
feature is shown to matter (turned off, the logits move far past the bound); and the paged,
chunked, batched runner equals the dense forward on the families whose attention or MLP
differ in kind (sliding windows, experts).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.models import FAMILIES, FAMILY_SEQ_LEN, family_config, family_tensors, family_token_ids, make_family
from tl.model import llama, loader
from tl.model.config import ModelConfig, load_model_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "families"
# float32 rounds each operation to 2^-24 relative; a logit here comes out of ~3 layers of dots
# over D + F <= 256 terms (plus norms, softmax, RoPE tables), so the two implementations'
# orders of summation can differ by ~2^8 roundings of values no larger than the largest
# logit: 2^-16 of it (measured: 5e-6 to 7e-6 at logits up to 17, i.e. ~2^-21).
REL_BOUND = 2.0**-16

_dense = jax.jit(llama.forward_dense, static_argnums=1)


def golden(name: str) -> np.ndarray:
    with np.load(GOLDEN / f"{name}.npz") as z:
        meta = json.loads(str(z["meta"]))
        assert meta["token_ids"] == family_token_ids().tolist(), "the golden data's tokens are not family_token_ids()"
        return z["logits"]


def tl_logits(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> np.ndarray:
    weights = loader.load_weights(tensors, cfg)
    return np.asarray(_dense(weights, cfg, jnp.asarray(family_token_ids()))[1])


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_directory_matches_transformers(name: str, tmp_path: Path) -> None:
    cfg = load_model_config(make_family(tmp_path, name))
    assert cfg == family_config(name)  # config.json round-trips through transformers' keys
    params, cfg = loader.load_params(str(tmp_path))
    got = np.asarray(_dense(params, cfg, jnp.asarray(family_token_ids()))[1])
    want = golden(name)
    assert got.shape == want.shape == (FAMILY_SEQ_LEN, cfg.vocab_size)
    assert np.abs(got - want).max() <= REL_BOUND * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95


# Each family's difference from Llama 2, turned off: the logits must move far past the bound.
ABLATIONS = {
    "llama3": {"rope_scaling": None},
    "mistral": {"sliding_window": 0, "layer_types": ()},
    "qwen3": {"qk_norm": False},
    "gemma3:window": {"sliding_window": 0, "layer_types": ()},
    "gemma3:local_rope": {"rope_local_theta": 0.0},
    "gemma3:scale": {"query_scale": 0.0},
    "gemma3:embed_scale": {"embed_scale": False},
    "gemma3:act": {"hidden_act": "silu"},
    "qwen3_moe:renorm": {"norm_topk_prob": False},
}


@pytest.mark.parametrize("case", ABLATIONS)
def test_each_family_feature_matters(case: str) -> None:
    name = case.split(":")[0]
    cfg = family_config(name)
    off = dataclasses.replace(cfg, **ABLATIONS[case])
    want = golden(name)
    assert np.abs(tl_logits(off, family_tensors(cfg)) - want).max() > 100 * REL_BOUND * np.abs(want).max()


@pytest.mark.parametrize("name", ["mistral", "gemma3", "qwen3_moe"])
def test_paged_chunked_batched_runner_matches_dense(name: str) -> None:
    """Sliding windows over the paged cache (blocks of 4, windows 8 and 16, chunks of 5, prompts
    longer than the windows) and experts in a batched step: the runner's greedy tokens and their
    logprobs are the dense forward's."""
    from tests.helpers.runner import ENGINE, Driver, Seq, dense_greedy
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start

    cfg = family_config(name)
    tensors = family_tensors(cfg)
    kernels = {"attention_kernel": "cpu_native", "matmul_kernel": "xla"}  # forced: no per-shape timing runs
    runner = ModelRunner(start(cfg, tensors, ENGINE.replace(**kernels)))
    ids = family_token_ids().tolist()
    seqs = [Seq(0, ids[:30], 12), Seq(1, ids[30:51], 12), Seq(2, ids[51:54], 12)]
    Driver(runner, seed=1).run(seqs)
    for s in seqs:
        want, want_lp = dense_greedy(tensors, cfg, s.prompt, s.max_new)
        assert s.out == want
        assert np.allclose(s.logprobs, want_lp, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_engine_prefix_cache_preemption_speculation_chunking(name: str) -> None:
    """The whole engine on a family with sliding windows (Gemma 3) or experts (Qwen3-MoE):
    prefix hits, preemption with recompute, prompt-lookup drafts and chunked prefill all at
    once, and every request gets exactly the tokens it gets alone, with exact block books."""
    from tests.helpers.differential import assert_concurrent_equals_alone
    from tests.helpers.engine_cases import CFG, NarrowKV, check_engine, workload
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start

    cfg = family_config(name)
    kernels = {"attention_kernel": "cpu_native", "matmul_kernel": "xla"}  # forced: no per-shape timing runs
    runner = ModelRunner(start(cfg, family_tensors(cfg), CFG.replace(speculative="prompt_lookup", **kernels)))
    everything = CFG.replace(num_kv_blocks=14, prefix_cache="radix", prefill_chunk=4, speculative="prompt_lookup")
    # The reference drafts too: a sampled row that verifies a draft draws from the same
    # distribution as without drafts, but not the same token (tl/runtime/sampler.py `sample`).
    engine = assert_concurrent_equals_alone(
        lambda c: NarrowKV(runner, c.num_kv_blocks),
        everything,
        CFG.replace(speculative="prompt_lookup"),
        workload(),
        check=check_engine,
    )
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_drafts_proposed > 0
    assert stats.kv_blocks_used == 0


def test_every_layer_sliding_frees_the_blocks_behind_the_window() -> None:
    """Mistral-style (every layer sliding, window 16, blocks of 4): a sequence holds at most
    window / block_size + 2 blocks however long it grows, the freed blocks serve the next
    requests, and the tokens are those of an engine that keeps every block."""
    from tests.helpers.differential import drive, token_ids
    from tests.helpers.engine_cases import CFG, check_engine
    from tl.core.engine import Engine
    from tl.core.request import GenRequest, SamplingParams
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start

    cfg = family_config("mistral")
    assert cfg.attention_window == 16 and family_config("gemma3").attention_window == 0
    kernels = {"attention_kernel": "cpu_native", "matmul_kernel": "xla"}
    runner = ModelRunner(start(cfg, family_tensors(cfg), CFG.replace(**kernels)))
    assert runner.attention_window == 16
    ids = tuple(int(t) for t in family_token_ids())
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    held: list[int] = []

    def books(engine: Engine) -> None:
        check_engine(engine)
        held.extend(engine.block_manager.num_held(s.seq_id) for s in engine.scheduler.running)

    cfg_engine = CFG.replace(num_kv_blocks=12, prefill_chunk=8)  # 12 blocks: 48 tokens, less than one sequence
    from tests.helpers.differential import Arrival

    arrivals = [Arrival(0, GenRequest(ids[:30], greedy)), Arrival(2, GenRequest(ids[30:50], greedy))]
    got = drive(Engine(runner, cfg_engine), arrivals, check=books)
    want = [drive(Engine(runner, CFG), [a])[0] for a in arrivals]  # 64 blocks: nothing needs freeing
    assert [token_ids(o) for o in got] == [token_ids(o) for o in want]
    assert all(len(token_ids(o)) == 40 for o in got)
    assert max(held) <= 16 // 4 + 2


GGUF_FORMS = {"llama3": "llama", "qwen3": "qwen3", "qwen3_moe_gguf": "qwen3moe", "gemma3_gguf": "gemma3"}


@pytest.mark.parametrize("name", GGUF_FORMS)
def test_gguf_form_matches_transformers(name: str, tmp_path: Path) -> None:
    """The same tiny model written as llama.cpp's converter writes a GGUF of its family (tensor
    names, llama's q/k row permutation, Gemma's 1 + w norms, stacked experts, Llama 3's
    rope_freqs; tests/model/test_gguf_families.py), served as it is: transformers' logits again."""
    from tests.helpers.gguf_writer import family_gguf
    from tl.model.convert_gguf import model_dir_of
    from tl.model.files import read_tensors

    cfg = family_config(name)
    meta: dict[str, object] = {}
    if name == "gemma3_gguf":
        meta = {
            "gemma3.attention.sliding_window_pattern": [t == "sliding_attention" for t in cfg.layer_types],
            "gemma3.rope.scaling.type": "linear",
            "gemma3.rope.scaling.factor": 2.0,
        }
    path = family_gguf(tmp_path / f"{name}.gguf", cfg, family_tensors(cfg), GGUF_FORMS[name], meta=meta)
    model_dir = model_dir_of(str(path))
    got_cfg = load_model_config(model_dir)
    weights = loader.load_weights(read_tensors(model_dir, packed=True), got_cfg, np.float32, "auto")
    got = np.asarray(_dense(weights, got_cfg, jnp.asarray(family_token_ids()))[1])
    want = golden(name)
    assert np.abs(got - want).max() <= REL_BOUND * np.abs(want).max()
