"""TextStream: generated token bytes -> text that is safe to send now.

Owns the two hold-back rules of streaming: an incomplete UTF-8 tail waits for its
next bytes (an invalid sequence becomes U+FFFD), and a suffix that is a proper prefix
of a stop string waits until it either completes the stop string (then the stream
stops, the stop string itself never sent) or stops being a prefix. The concatenation
of everything push/finish return is the non-streamed text, so both paths share this.
Pure Python; tested byte by byte by tests/serve/test_textstream.py.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = tuple(s for s in stops if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        """True once a stop string occurred; later pushes return ''."""
        return self._stopped

    def push(self, data: bytes) -> str:
        """Append one token's bytes; return the text that may be sent now."""
        if self._stopped:
            return ""
        return self._release(self._held + self._decoder.decode(data), final=False)

    def finish(self) -> str:
        """No more tokens: flush the incomplete tail (as U+FFFD) and the held text."""
        if self._stopped:
            return ""
        return self._release(self._held + self._decoder.decode(b"", final=True), final=True)

    def _release(self, text: str, final: bool) -> str:
        hits = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        cut = min(hits)[0] if hits else -1
        if cut >= 0:
            self.matched = min(hits)[1]
            self._stopped = True
            self._held = ""
            return text[:cut]
        keep = 0 if final else self._held_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
