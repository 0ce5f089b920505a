"""Report formatting shared by every benchmark: Markdown tables (and JSON lines by callers).

Owns presentation only. Imports nothing from tl.
"""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    if not rows:
        return "(no rows)"
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def print_table(rows: Sequence[dict[str, object]]) -> None:
    print(markdown_table(rows))
