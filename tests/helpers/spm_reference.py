"""llama.cpp's SentencePiece ("llama" vocabulary) tokenizer, in plain Python: the reference tl's
tokenizer.json of a GGUF is checked against (tests/model/test_gguf_tokenizer.py).

Follows llama-vocab.cpp: the text is first cut at added tokens (user-defined always, control
tokens when `parse_special`), longest token first, each token's occurrences left to right;
each remaining stretch gets a space prefix where `add_space_prefix` says so (at the start and
after an added token), its spaces become '▁', and llm_tokenizer_spm_session merges it: from
single characters, repeatedly join the adjacent pair whose joined text is a token of highest
score (ties: leftmost); characters left that are no token become their UTF-8 bytes' <0xNN>
tokens. Imports nothing from tl.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

CONTROL, USER_DEFINED = 3, 4


class SpmReference:
    """llama.cpp's tokenization over one vocabulary (`encode`)."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int],
        *,
        add_space_prefix: bool = False,
        parse_special: bool = True,
    ) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.scores, self.add_space_prefix = scores, add_space_prefix
        kinds = (CONTROL, USER_DEFINED) if parse_special else (USER_DEFINED,)
        added = (i for i, ty in enumerate(types) if ty in kinds and tokens[i])
        self.added = [(tokens[i], i) for i in sorted(added, key=lambda i: -len(tokens[i]))]

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        prev_special = True
        for frag in self._partition(text):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            piece = (" " if self.add_space_prefix and prev_special else "") + frag
            out += _merge(piece.replace(" ", "\u2581"), self.vocab, self.scores)
            prev_special = False
        return out

    def _partition(self, text: str) -> list[str | int]:
        frags: list[str | int] = [text] if text else []
        for s, sid in self.added:
            if not any(isinstance(f, str) and s in f for f in frags):
                continue
            nxt: list[str | int] = []
            for f in frags:
                while isinstance(f, str) and (k := f.find(s)) >= 0:
                    nxt += [f[:k], sid] if k else [sid]
                    f = f[k + len(s) :]
                if f != "":
                    nxt.append(f)
            frags = nxt
        return frags


def _merge(text: str, vocab: dict[str, int], scores: Sequence[float]) -> list[int]:
    sym = list(text)  # one symbol per character; '' once merged into its left neighbour
    nxt, prv = list(range(1, len(sym))) + [-1], list(range(-1, len(sym) - 1))
    heap: list[tuple[float, int, int, int]] = []

    def add(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (i := vocab.get(sym[left] + sym[right])) is not None:
            heapq.heappush(heap, (-scores[i], left, right, len(sym[left]) + len(sym[right])))

    for i in range(1, len(sym)):
        add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left], sym[right] = sym[left] + sym[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        add(prv[left], left)
        add(left, nxt[left])
    out: list[int] = []
    for s in sym:
        if s and s in vocab:
            out.append(vocab[s])
        elif s:
            out += [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out
