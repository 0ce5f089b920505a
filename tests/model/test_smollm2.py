"""End-to-end checks on the real SmolLM2-135M-Instruct (converted from its Q4_1 GGUF).

The reference is tests/helpers/numpy_gguf_reference.py: plain numpy over the GGUF tensors as
llama.cpp stores them (permuted q/k rows, adjacent-pair RoPE), sharing no code with tl.
So these tests check the converter's un-permutation, the JAX forward, the paged runner,
the engine and the tokenizer against one independent implementation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.numpy_gguf_reference import GGUFModel

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="session")
def reference(smol_gguf: Path) -> GGUFModel:
    return GGUFModel.load(str(smol_gguf))


@pytest.fixture(scope="session")
def prompt_ids(smol_dir: Path) -> list[int]:
    from tl.text.chat_template import ChatTemplate
    from tl.text.tokenizer import Tokenizer

    text = ChatTemplate.from_model_dir(smol_dir).render([{"role": "user", "content": QUESTION}])
    ids = Tokenizer.load(smol_dir).encode(text)
    assert len(ids) > 20
    return ids


def test_dense_forward_matches_numpy_reference(smol_dir: Path, reference: GGUFModel, prompt_ids: list[int]) -> None:
    from tl.model.llama import forward_dense
    from tl.model.loader import load_params

    ids = prompt_ids[-20:]
    params, cfg = load_params(smol_dir, "float32")
    _, logits = forward_dense(params, cfg, np.asarray(ids, np.int32))
    want = reference.logits(ids)  # float64 arithmetic, rounded to float32 at the end
    diff = float(np.max(np.abs(np.asarray(logits) - want)))
    # float32 against float64: each layer's products round with a relative error of about
    # sqrt(K) u (K the longest contraction, the MLP's 1536; a random walk of K roundings, the
    # statistical bound), and the residual stream adds the layers' errors: L sqrt(K) u of the
    # logits' scale. A wrong RoPE pairing or a misplaced row is off by whole logits.
    u, k = 2.0**-24, max(cfg.intermediate_size, cfg.hidden_size)
    bound = cfg.num_hidden_layers * np.sqrt(k) * u * float(np.max(np.abs(want)))
    assert diff < bound, f"max |dlogit| {diff} over the float32 bound {bound}"


def test_engine_greedy_matches_reference_and_answers(
    smol_dir: Path, reference: GGUFModel, prompt_ids: list[int]
) -> None:
    from tl.core.config import EngineConfig
    from tl.core.request import GenRequest, SamplingParams
    from tl.entry.build import build_engine
    from tl.text.tokenizer import Tokenizer

    cfg = EngineConfig(
        model_dir=str(smol_dir),
        num_kv_blocks=64,
        max_num_seqs=1,
        seq_buckets=(1,),  # one step variant (16 tokens, one sequence): one compile
        token_buckets=(16,),
        max_num_batched_tokens=16,
        prefill_chunk=16,
        weight_dtype="float32",  # the reference is the float model (the GGUF dequantized)
    )
    engine = build_engine(cfg, warmup=False)
    rid = engine.add_request(
        GenRequest(tuple(prompt_ids), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    )
    got: list[int] = []
    while engine.has_work():
        got += [o.token_id for o in engine.step() if o.request_id == rid and o.token_id >= 0]
    want = reference.greedy(prompt_ids, 32)
    assert got == want
    text = Tokenizer.load(smol_dir).decode(got)
    assert "Paris" in text, text


def test_default_config_serves_the_gguf_as_llama_cpp_does(smol_dir: Path) -> None:
    """The default weight_dtype "auto" serves the pulled GGUF as it is (Q4_1 layers, a Q8_0
    embedding and tied head), every step of up to 64 rows through the native integer-dot
    kernels (activations quantized to int8 per block of 32, as llama.cpp does), and answers as
    llama.cpp or as the float model of the same values does. The first token is a near tie:
    the float model (tests/helpers/numpy_gguf_reference.py, float64) gives "The" 25.325 and "L" 25.243.
    llama.cpp (llama-server from the llama-cpp-python 0.3.36 sdist, greedy) answers "L'Étoile,
    la Marseillaise,", the float model "The capital of France is Paris.". tl's kernels sum each
    block exactly and scale it once with x's block scale kept in float32 (llama.cpp rounds it to
    half); on AVX-512 VNNI they answer as the float model, on AVX2 (Zen 3) "L'Étoile, la Cité,":
    the float model's own eighth token is a near tie too (" Mar" 2.690, " Cit" 2.525, float64 teacher-forced
    on that answer, every other token its top choice). The AVX2 kernels before, which scaled each
    4-product lane, answered as llama.cpp. A wrong nibble, scale or sign answers none of these."""
    from tl.core.config import EngineConfig
    from tl.core.request import GenRequest, SamplingParams
    from tl.entry.build import build_engine
    from tl.model.encodings.blocks import Blocks
    from tl.model.encodings.panels import Panels
    from tl.text.chat_template import ChatTemplate
    from tl.text.tokenizer import Tokenizer

    cfg = EngineConfig(
        model_dir=str(smol_dir),
        num_kv_blocks=64,
        max_num_seqs=1,
        seq_buckets=(1,),
        token_buckets=(1, 64),
        max_num_batched_tokens=64,
        prefill_chunk=64,
        matmul_kernel="cpu_native",  # every step natively, whatever this CPU's verdicts
    )
    engine = build_engine(cfg, warmup=False)
    params = engine.runner.params
    # The file's formats: as stored, or repacked into panels where the plan says (AVX-512 VNNI).
    layout = engine.runner.plan.weight_layout.value
    if layout == "panels":
        assert isinstance(params.layers[0].w_down, Panels) and isinstance(params.embed, Panels)
        assert (params.layers[0].w_down.fmt, params.embed.fmt) == ("q4_1", "q8_0")
    else:
        assert type(params.layers[0].w_down).__name__ == "Q4_1" and type(params.embed).__name__ == "Q8_0"
        assert isinstance(params.embed, Blocks)
    tok = Tokenizer.load(smol_dir)
    chat = ChatTemplate.from_model_dir(smol_dir).render(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    rid = engine.add_request(GenRequest(tuple(tok.encode(chat)), SamplingParams(temperature=0.0, max_tokens=10)))
    got: list[int] = []
    while engine.has_work():
        got += [o.token_id for o in engine.step() if o.request_id == rid and o.token_id >= 0]
    # The first tokens: later ones sit on near-ties that float rounding (the attention kernel's
    # one-call or two-part form) can flip ("Marseilla" at 64-token steps, "Marsebe" at one).
    text = tok.decode(got)
    assert text.startswith(("L'Étoile, la Mars", "L'Étoile, la Cité", "The capital of France is Paris.")), text
