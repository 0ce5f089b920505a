"""Regenerate gemma3_270m_llama_cpp_tokens.json: llama.cpp's token ids for CASES on the Gemma 3
270M GGUF that `tl pull gemma3-270m` keeps, the reference tests/model/test_gguf_tokenizer.py checks tl's
tokenizer.json against.

    .venv/bin/python tests/golden/make_gemma3_tokens.py LLAMA_TOKENIZE artifacts/models/gemma3-270m/model.gguf

LLAMA_TOKENIZE is llama.cpp's `llama-tokenize` (built from llama-cpp-python's sdist, see the
report in the commit); each text goes through a file (`-f`, read verbatim, `--no-escape`: a backslash-n stays two
characters), special tokens parsed (its default), no BOS.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "a  b   c    d     e",
    " " * 40,
    "\n",
    "line one\nline two\n\nline four\n\n\n\nend",
    "\t\tindented\twith tabs\t",
    "mixed \t \n \r\n whitespace",
    "Héllo wörld, ça va? Ñandú, Ærøskøbing, naïve façade, Dvořák.",
    "世界你好！日本語のテキストと한국어 텍스트。",
    "Emoji: 🙂👍🏽 🇫🇷 👩‍👩‍👧 ❤️ and ✓",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "Numbers 12345, 3.14159, -0.5e10, 2024-01-31 and $1,000.00; 100%",
    '{"json": [1, 2, {"k": null}], "esc": "\\n\\u00e9"}',
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos",
    "a<eos>b<pad>c",
    "<div><span>html</span></div>",
    "<0x41> is not a byte token",
    "unknown bytes: \x00\x01\x7f and \u0378\u0380 and \U000e0001 tag",
    "Cyrillic ё Ё and Georgian ქართული and Thai ภาษาไทย",
    "ﬁ ligature, ＦＵＬＬＷＩＤＴＨ, ①②③ and ½ ¼",
    "zero\u200bwidth\u200dspace\ufeffbom",
    "it's don't I'll we've they're YOU'RE",
    "snake_case_identifier and camelCaseIdentifier and SCREAMING_CASE",
    "https://example.com/path?query=1&x=y#frag",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "🙂" * 5 + "x" + "\u0301" * 3,
    "",
]


def llama_cpp_ids(binary: str, gguf: str, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        cmd = [binary, "-m", gguf, "-f", f.name, "--no-escape", "--ids", "--no-bos", "--log-disable"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    finally:
        Path(f.name).unlink()
    return [int(x) for x in out.strip().splitlines()[-1].strip("[] \n").split(",") if x.strip()]


def main() -> None:
    binary, gguf = sys.argv[1], sys.argv[2]
    digest = hashlib.sha256(Path(gguf).read_bytes()).hexdigest()
    cases = [{"text": t, "ids": llama_cpp_ids(binary, gguf, t) if t else []} for t in CASES]
    doc = {
        "model": "gemma3-270m (tl pull), sha256 " + digest,
        "reference": "llama.cpp llama-tokenize (llama-cpp-python 0.3.36 sdist): -f FILE --no-escape --ids --no-bos",
        "cases": cases,
    }
    out = Path(__file__).with_name("gemma3_270m_llama_cpp_tokens.json")
    head = json.dumps({k: v for k, v in doc.items() if k != "cases"}, indent=1, ensure_ascii=False)[:-2]
    rows = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in cases)
    out.write_text(f'{head},\n "cases": [\n  {rows}\n ]\n}}\n', encoding="utf-8")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
