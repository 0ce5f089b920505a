"""Regenerate gemma3_270m_llama_cpp_greedy.json: llama.cpp's greedy continuations (and each step's
top-5 [id, logprob] of the full softmax) on the Gemma 3 270M GGUF that `tl pull gemma3-270m` keeps, golden data
for the forward pass (no test in this file's owner's scope reads it yet).

    llama-server -m artifacts/models/gemma3-270m/model.gguf --port 18099 -c 2048 -t 1 &
    .venv/bin/python tests/golden/make_gemma3_greedy.py http://127.0.0.1:18099

The prompt ids are llama.cpp's own tokenization with its BOS (the file's add_bos_token);
sampling is top_k 1 at temperature 0, 16 tokens, on CPU (llama-server from llama-cpp-python
0.3.36's sdist, GGML_NATIVE).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, my friend.\nFrench:",
    "Les mathématiques sont",
    "日本の首都は",
]


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, object] = json.loads(r.read())
    return out


def main() -> None:
    base = sys.argv[1].rstrip("/")
    cases = []
    for prompt in PROMPTS:
        ids = post(f"{base}/tokenize", {"content": prompt, "add_special": True})["tokens"]
        d = post(
            f"{base}/completion",
            {"prompt": prompt, "n_predict": 16, "temperature": 0, "top_k": 1, "n_probs": 5, "return_tokens": True},
        )
        steps = [
            [[p["id"], round(p["logprob"], 5)] for p in step["top_logprobs"]]
            for step in d["completion_probabilities"]  # type: ignore[union-attr]
        ]
        cases.append(
            {"prompt": prompt, "prompt_ids": ids, "ids": d["tokens"], "text": d["content"], "top5_logprobs": steps}
        )
    doc = {
        "model": "gemma3-270m (tl pull), sha256 a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "reference": "llama.cpp llama-server (llama-cpp-python 0.3.36 sdist, CPU): top_k 1, temperature 0; "
        "top5_logprobs: [id, logprob] of the raw softmax",
    }
    head = json.dumps(doc, indent=1, ensure_ascii=False)[:-2]
    rows = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in cases)
    out = Path(__file__).with_name("gemma3_270m_llama_cpp_greedy.json")
    out.write_text(f'{head},\n "cases": [\n  {rows}\n ]\n}}\n', encoding="utf-8")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
