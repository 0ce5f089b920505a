"""tl.text.tokenizer: the byte tokenizer (one token per byte), token bytes vs decode,
incremental UTF-8, eos id resolution, load errors, and SmolLM2's tokenizer against an
independent reference (slow).

The reference is transformers' GGUF tokenizer builder (convert_gguf_tokenizer), fed
the GGUF's metadata as read by the `gguf` package: it builds the vocabulary, merges,
special tokens and pre-tokenizer with its own code, not ours. (transformers' own GGUF
file reader needs torch, which this project does not install.)
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.models import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, make_tiny_llama
from tl.model.config import ModelDirError
from tl.model.files import eos_token_ids
from tl.text.chat_template import ChatTemplate
from tl.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_dir)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_one_token_per_byte(byte_tok: Tokenizer, text: str) -> None:
    data = text.encode("utf-8")
    ids = byte_tok.encode(text.replace("<|", "<"))  # keep accidental specials out
    assert ids == list(text.replace("<|", "<").encode("utf-8"))
    assert byte_tok.decode(list(data)) == text
    assert b"".join(byte_tok.token_bytes(b) for b in data) == data


def test_byte_tokenizer_specials_are_single_tokens(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("<|im_start|>user\nhé<|im_end|><|endoftext|>")
    assert ids == [IM_START_ID, *b"user\nh\xc3\xa9", IM_END_ID, ENDOFTEXT_ID]
    assert byte_tok.token_bytes(IM_END_ID) == b"<|im_end|>"
    assert byte_tok.decode(ids) == "<|im_start|>user\nhé<|im_end|><|endoftext|>"
    assert byte_tok.decode(ids, skip_special_tokens=True) == "user\nhé"
    assert byte_tok.special_tokens == {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    assert (byte_tok.vocab_size, byte_tok.bos_token, byte_tok.eos_token) == (259, "<|im_start|>", "<|im_end|>")
    assert byte_tok.encode("<|im_end") == list(b"<|im_end")  # an incomplete special is plain text
    assert byte_tok.token_bytes(10_000) == b"" and byte_tok.token_bytes(-1) == b""


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 258), max_size=40))
def test_decode_is_joined_token_bytes_even_mid_character(byte_tok: Tokenizer, ids: list[int]) -> None:
    joined = b"".join(byte_tok.token_bytes(i) for i in ids)
    assert byte_tok.decode(ids) == joined.decode("utf-8", "replace")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    streamed = "".join(decoder.decode(byte_tok.token_bytes(i)) for i in ids) + decoder.decode(b"", final=True)
    assert streamed == byte_tok.decode(ids)


def test_eos_ids_are_generation_config_then_config_then_the_eos_token(tmp_path: Path) -> None:
    """tl.model.files.eos_token_ids, the rule the runner (and so the engine) stops by: every
    source, in order, once each; the EOS token looked up in tokenizer.json or by a loaded
    tokenizer alike."""

    def by_tokenizer(d: Path) -> tuple[int, ...]:
        return eos_token_ids(d, Tokenizer.load(d).token_to_id)

    d = make_tiny_llama(tmp_path / "m")  # config.json and tokenizer_config.json: <|im_end|>
    (d / "generation_config.json").write_text('{"eos_token_id": [256, 258]}')
    assert eos_token_ids(d) == by_tokenizer(d) == (256, IM_END_ID)
    (d / "generation_config.json").unlink()
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tcfg, "eos_token": "<|endoftext|>"}))
    assert eos_token_ids(d) == by_tokenizer(d) == (IM_END_ID, ENDOFTEXT_ID)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "eos_token_id"}))
    assert eos_token_ids(d) == by_tokenizer(d) == (ENDOFTEXT_ID,)  # only the tokenizer's EOS token names one
    (d / "tokenizer_config.json").unlink()
    assert eos_token_ids(d) == by_tokenizer(d) == () and Tokenizer.load(d).eos_token is None


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m")
    spec = (d / "tokenizer.json").read_text()
    (d / "tokenizer.json").write_text(spec[:100])
    with pytest.raises(ModelDirError, match="tokenizer.json: not valid JSON"):
        Tokenizer.load(d)
    (d / "tokenizer.json").write_text(json.dumps({**json.loads(spec), "model": {"type": "Nope"}}))
    with pytest.raises(ModelDirError, match="tokenizer.json: cannot build the tokenizer"):
        Tokenizer.load(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelDirError, match="tokenizer.json: file not found"):
        Tokenizer.load(d)


CORPUS = [
    "Hi",
    "What is the capital of France? Answer in one word.",
    "Héllo wörld, ça va? Ñandú, Ærøskøbing, naïve façade, Dvořák.",
    "世界你好！日本語のテキストと한국어 텍스트。",
    "Emoji: 🙂👍🏽 🇫🇷 👩‍👩‍👧 ❤️ and ✓",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "Numbers 12345, 3.14159, -0.5e10, 2024-01-31 and $1,000.00; 100%",
    "   leading spaces, tabs\tand\n\n\nnewlines   \r\n trailing ",
    "it's don't I'll we've they're YOU'RE",
    "<|im_start|> inside text <|im_end|> and <|endoftext|>",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    '{"json": [1, 2, {"k": null}], "esc": "\\n\\u00e9"}',
]


@pytest.fixture(scope="module")
def smol_reference(smol_gguf: Path):  # type: ignore[no-untyped-def]
    import gguf
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
    )

    reader = gguf.GGUFReader(str(smol_gguf))
    meta = {
        k: reader.fields[f"tokenizer.ggml.{k}"].contents()
        for k in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id")
    }
    tokenizer_dict = {
        "tokenizer_type": meta["model"],
        "pre_tokenizer_type": meta["pre"],
        "tokens": meta["tokens"],
        "token_type": meta["token_type"],
        "merges": meta["merges"],
        "add_prefix_space": False,
        "bos_token_id": meta["bos_token_id"],
        "eos_token_id": meta["eos_token_id"],
    }
    backend, _ = convert_gguf_tokenizer(reader.fields["general.architecture"].contents(), tokenizer_dict)
    return backend


@pytest.fixture(scope="module")
def smol_tok(smol_dir: Path) -> Tokenizer:
    return Tokenizer.load(smol_dir)


@pytest.mark.slow
def test_smollm2_matches_reference_on_chat_prompts(smol_dir: Path, smol_tok: Tokenizer, smol_reference) -> None:  # type: ignore[no-untyped-def]
    template = ChatTemplate.from_model_dir(smol_dir)
    for text in CORPUS:
        for messages in (
            [{"role": "user", "content": text}],
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": text},
                {"role": "assistant", "content": text[::-1]},
                {"role": "user", "content": "More"},
            ],
        ):
            prompt = template.render(messages)
            want = smol_reference.encode(prompt, add_special_tokens=False).ids
            got = smol_tok.encode(prompt)
            assert got == want, prompt
            assert got[0] == 1  # <|im_start|>
            assert smol_tok.decode(got) == prompt


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True)
# Without "No"/"Nl" characters (superscripts, fractions, roman numerals): the converted
# tokenizer.json's Digits(individual_digits) pre-tokenizer splits off every Unicode numeric
# character and the GGUF reference's pre-tokenizer regex does not (" ²": ours [Ġ, Â²], the
# reference [ĠÂ, ²]); a random draw of this test found it. Derandomized: a failure reproduces.
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs", "No", "Nl")), max_size=60))
def test_smollm2_matches_reference_on_random_text(smol_tok: Tokenizer, smol_reference, text: str) -> None:  # type: ignore[no-untyped-def]
    assert smol_tok.encode(text) == smol_reference.encode(text, add_special_tokens=False).ids


@pytest.mark.slow
def test_smollm2_token_bytes_and_properties(smol_tok: Tokenizer, smol_dir: Path) -> None:
    assert smol_tok.vocab_size == 49152
    assert (smol_tok.bos_token, smol_tok.eos_token, eos_token_ids(smol_dir)) == ("<|im_start|>", "<|im_end|>", (2,))
    assert smol_tok.special_tokens["<|im_end|>"] == 2 and len(smol_tok.special_tokens) == 17
    assert smol_tok.token_bytes(smol_tok.encode(" the")[0]) == b" the"
    text = "naïve 🙂 世界"
    ids = smol_tok.encode(text)
    assert b"".join(smol_tok.token_bytes(i) for i in ids) == text.encode()
    assert smol_tok.decode(ids) == smol_tok._tok.decode(ids) == text
    assert sum(len(smol_tok.token_bytes(i)) == 0 for i in range(smol_tok.vocab_size)) == 0
