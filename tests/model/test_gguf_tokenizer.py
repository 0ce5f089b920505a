"""tl.model.gguf_tokenizer: SentencePiece ("llama") vocabularies of GGUFs as tokenizer.json.

Three independent references:
- tests/helpers/spm_reference.py, llama.cpp's SPM tokenizer re-written in plain Python, on tiny
  vocabularies with shuffled scores (so merge order is the scores', not the file's), with and
  without the space prefix;
- transformers' GGUF Gemma tokenizer builder (its own merges, normalizer and added tokens), on
  tiny vocabularies ordered as Gemma's file is;
- llama.cpp itself: tests/golden/gemma3_270m_llama_cpp_tokens.json, llama-tokenize's ids on the
  real Gemma 3 270M GGUF (slow: it needs `tl pull gemma3-270m`), where the Python reference is
  also run on random text.
Plus token bytes and decoding of '▁' and <0xNN> pieces, BOS on prompts, and errors.
"""

from __future__ import annotations

import codecs
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.gguf_writer import write_gguf
from tests.helpers.spm_reference import SpmReference
from tl.model.gguf_model import open_gguf
from tl.model.gguf_tokenizer import GGUFError, TokenizerMeta, tokenizer_config, tokenizer_json, tokenizer_meta
from tl.text.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "gemma3_270m_llama_cpp_tokens.json"
CONTROL = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
USER_DEFINED = ("\n", "\n\n", "\n\n\n", "  ", "   ", "\t", "\t\t", "<b>")
ALPHABET = "ab▁nè世"
TEXT_CHARS = "ab nè世\n\tz🙂<>_"  # z and 🙂 are no piece: byte fallback


def spm_vocab(seed: int, shuffle_scores: bool) -> tuple[list[str], list[float], list[int]]:
    """A tiny SentencePiece vocabulary laid out as Gemma's GGUF is: control tokens, user-defined
    ones (newline, space and tab runs, a tag), the 256 byte pieces, then the single characters
    and 150 random pieces of 2-5 of them, scores -rank in file order (or shuffled)."""
    rng = random.Random(seed)
    pieces: set[str] = set()
    while len(pieces) < 150:
        p = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 5)))
        if p.strip("▁"):  # whitespace-only pieces: Gemma's are user-defined runs of spaces
            pieces.add(p)
    normal = [*ALPHABET, *sorted(pieces)]
    ranks = list(range(len(normal)))
    if shuffle_scores:
        rng.shuffle(ranks)
    tokens = [*CONTROL, *USER_DEFINED, *(f"<0x{b:02X}>" for b in range(256)), *normal]
    types = [3] * len(CONTROL) + [4] * len(USER_DEFINED) + [6] * 256 + [1] * len(normal)
    scores = [-1000.0] * (len(CONTROL) + len(USER_DEFINED)) + [0.0] * 256 + [-float(r) for r in ranks]
    return tokens, scores, types


def spm_meta(tokens: list[str], scores: list[float], types: list[int], space_prefix: bool) -> dict[str, object]:
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": space_prefix,
    }


def tokenizer_dir(out: Path, gguf_path: Path) -> Path:
    """tokenizer.json and tokenizer_config.json of the GGUF, as convert_gguf writes them."""
    meta = tokenizer_meta(open_gguf(gguf_path), gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(meta, gguf_path)), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta, 128)), encoding="utf-8")
    return out


def tiny_spm(tmp: Path, seed: int, *, shuffle_scores: bool, space_prefix: bool) -> tuple[Tokenizer, SpmReference]:
    tokens, scores, types = spm_vocab(seed, shuffle_scores)
    path = write_gguf(tmp / "spm.gguf", "gemma3", {}, spm_meta(tokens, scores, types, space_prefix))
    ref = SpmReference(tokens, scores, types, add_space_prefix=space_prefix)
    return Tokenizer.load(tokenizer_dir(tmp / "tok", path)), ref


@pytest.fixture(scope="module", params=[(0, False), (1, True), (2, False)], ids=["seed0", "seed1-prefix", "seed2"])
def shuffled(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Tokenizer, SpmReference]:
    seed, prefix = request.param
    return tiny_spm(tmp_path_factory.mktemp("spm"), seed, shuffle_scores=True, space_prefix=prefix)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.sampled_from(TEXT_CHARS), max_size=40) | st.text(max_size=20))
def test_spm_matches_llama_cpp_reference(shuffled: tuple[Tokenizer, SpmReference], text: str) -> None:
    tok, ref = shuffled
    for t in (text, f"<start_of_turn>{text}<end_of_turn>{text}"):
        assert tok.encode(t) == ref.encode(t), repr(t)


@pytest.fixture(scope="module")
def gemma_like(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tmp = tmp_path_factory.mktemp("gemma-like")
    tokens, scores, types = spm_vocab(7, shuffle_scores=False)
    path = write_gguf(tmp / "spm.gguf", "gemma3", {}, spm_meta(tokens, scores, types, False))
    backend, _ = convert_gguf_tokenizer(
        "gemma3",
        {"tokenizer_type": "llama", "tokens": tokens, "scores": scores, "token_type": types, "add_prefix_space": False},
    )
    return Tokenizer.load(tokenizer_dir(tmp / "tok", path)), backend


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.sampled_from(TEXT_CHARS), max_size=40))
def test_spm_matches_transformers_gemma_builder(gemma_like: tuple[Tokenizer, Any], text: str) -> None:
    tok, reference = gemma_like
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_spm_token_bytes_and_decode(tmp_path: Path) -> None:
    tok, _ = tiny_spm(tmp_path, 3, shuffle_scores=True, space_prefix=False)
    text = "ab nè\n\n世  z🙂\t<b>"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.decode(ids) == text
    assert tok.token_bytes(tok.encode(" ")[0]) == b" "  # '▁'
    assert [tok.token_bytes(i) for i in tok.encode("z")] == [b"z"]  # <0x7A>
    emoji = tok.encode("🙂")
    assert [tok.token_bytes(i) for i in emoji] == [bytes([b]) for b in "🙂".encode()]  # four <0xNN>
    decoder = codecs.getincrementaldecoder("utf-8")()
    assert "".join(decoder.decode(tok.token_bytes(i)) for i in emoji) == "🙂"
    assert tok.encode("<start_of_turn>") == [4] and tok.special_token_ids >= {0, 1, 2, 3, 4, 5}
    assert 6 not in tok.special_token_ids  # user-defined "\n": an added token, not special
    assert tok.decode(tok.encode("<bos>ab"), skip_special_tokens=True) == "ab"


def test_space_prefix_is_stripped_from_the_first_token_when_decoding(tmp_path: Path) -> None:
    tok, ref = tiny_spm(tmp_path, 4, shuffle_scores=True, space_prefix=True)
    ids = tok.encode("ab")
    assert ids == ref.encode("ab") and tok.token_bytes(ids[0]).startswith(b" ")
    assert tok.decode(ids) == "ab"


def test_prompts_begin_with_bos_where_the_tokenizer_adds_it(tmp_path: Path, tiny_dir: Path) -> None:
    tok, _ = tiny_spm(tmp_path, 5, shuffle_scores=False, space_prefix=False)
    assert tok.add_bos_token and tok.bos_token == "<bos>"
    assert tok.encode_prompt("ab") == [2, *tok.encode("ab")]
    assert tok.encode_prompt("<bos>ab") == tok.encode("<bos>ab") == [2, *tok.encode("ab")]  # templates that write it
    assert tok.encode_prompt("") == [2]
    byte_tok = Tokenizer.load(tiny_dir)  # add_bos_token absent (and false for BPE GGUFs)
    assert not byte_tok.add_bos_token and byte_tok.encode_prompt("hi") == byte_tok.encode("hi")


def test_tokenizer_config_carries_the_gguf_flags(tmp_path: Path) -> None:
    tokens, scores, types = spm_vocab(6, shuffle_scores=False)
    meta = spm_meta(tokens, scores, types, False)
    path = write_gguf(tmp_path / "a.gguf", "gemma3", {}, meta)
    cfg = json.loads((tokenizer_dir(tmp_path / "a", path) / "tokenizer_config.json").read_text())
    assert (cfg["add_bos_token"], cfg["add_eos_token"], cfg["bos_token"], cfg["eos_token"]) == (
        True,
        False,
        "<bos>",
        "<eos>",
    )
    assert cfg["unk_token"] == "<unk>" and cfg["pad_token"] == "<pad>"
    del meta["tokenizer.ggml.add_bos_token"], meta["tokenizer.ggml.add_space_prefix"]
    path = write_gguf(tmp_path / "b.gguf", "llama", {}, meta)
    spec = tokenizer_json(tokenizer_meta(open_gguf(path), path), path)
    assert tokenizer_meta(open_gguf(path), path).add_bos_token  # llama.cpp's SPM default
    assert spec["normalizer"]["type"] == "Sequence"  # and its space prefix
    assert spec["model"]["byte_fallback"] and spec["decoder"]["decoders"][-1]["type"] == "Strip"


def test_unsupported_tokenizers_are_named(tmp_path: Path) -> None:
    tokens, scores, types = spm_vocab(0, shuffle_scores=False)
    meta = spm_meta(tokens, scores, types, False)
    path = write_gguf(tmp_path / "t5.gguf", "gemma3", {}, {**meta, "tokenizer.ggml.model": "t5"})
    with pytest.raises(
        GGUFError, match=r"t5.gguf: tokenizer.ggml.model 't5' is not supported \(supported: gpt2, llama\)"
    ):
        tokenizer_meta(open_gguf(path), path)
    path = write_gguf(tmp_path / "short.gguf", "gemma3", {}, {**meta, "tokenizer.ggml.scores": scores[:10]})
    with pytest.raises(GGUFError, match="short.gguf: tokenizer.ggml.scores must give one score per token"):
        tokenizer_meta(open_gguf(path), path)
    dup = TokenizerMeta("llama", "default", ("a", "a"), (1, 1), (0.0, -1.0), (), {}, True, False, False, None)
    with pytest.raises(GGUFError, match="dup.gguf: tokenizer.ggml.tokens has duplicate entries"):
        tokenizer_json(dup, Path("dup.gguf"))


# The real Gemma 3 270M: llama.cpp's own ids (golden), and the Python reference on random text.


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    from tl.entry.pull import pull

    return pull("gemma3-270m", root=REPO_ROOT / "artifacts" / "models", progress=False)


@pytest.fixture(scope="module")
def gemma_tok(gemma_dir: Path) -> Tokenizer:
    return Tokenizer.load(gemma_dir)


@pytest.mark.slow
def test_gemma3_matches_llama_cpp_golden(gemma_tok: Tokenizer) -> None:
    cases = json.loads(GOLDEN.read_text(encoding="utf-8"))["cases"]
    assert len(cases) >= 30
    for case in cases:
        assert gemma_tok.encode(case["text"]) == case["ids"], repr(case["text"])
        joined = b"".join(gemma_tok.token_bytes(i) for i in case["ids"])
        assert joined == case["text"].encode(), repr(case["text"])  # specials spelled as their text


@pytest.fixture(scope="module")
def gemma_reference(gemma_dir: Path) -> SpmReference:
    path = gemma_dir / "model.gguf"
    meta = tokenizer_meta(open_gguf(path), path)
    return SpmReference(meta.tokens, meta.scores, meta.types, add_space_prefix=meta.add_space_prefix)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_gemma3_matches_llama_cpp_reference_on_random_text(
    gemma_tok: Tokenizer, gemma_reference: SpmReference, text: str
) -> None:
    assert gemma_tok.encode(text) == gemma_reference.encode(text)


@pytest.mark.slow
def test_gemma3_tokenizer_facts(gemma_tok: Tokenizer) -> None:
    assert gemma_tok.vocab_size == 262144 and (gemma_tok.bos_token, gemma_tok.eos_token) == ("<bos>", "<eos>")
    assert gemma_tok.encode_prompt("Hello")[:1] == [2] and gemma_tok.add_bos_token
    assert gemma_tok.token_bytes(gemma_tok.token_to_id("<0x0A>") or 0) == b"\n"
    assert gemma_tok.token_bytes(gemma_tok.token_to_id("▁the") or 0) == b" the"
