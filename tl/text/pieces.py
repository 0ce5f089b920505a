"""A parser's output as pieces: plain text beside its own typed pieces (tool calls, reasoning).

Owns `add_text`, the one rule both streaming parsers keep: plain text joins the last piece where
that is plain text too, so consecutive text comes out as one piece. Used by tl/text/tools.py and
tl/text/reasoning.py.
"""

from __future__ import annotations

from typing import Any


def add_text(out: list[Any], text: str) -> None:
    """`text` appended to `out` (a list of pieces, str among them: a list is invariant, so no one
    type names every parser's): joined to its last piece where that is a str; nothing if empty."""
    if not text:
        return
    last = out[-1] if out else None
    if isinstance(last, str):
        out[-1] = last + text
    else:
        out.append(text)
