"""TextStream: incremental UTF-8 and stop-string hold-back, byte by byte (text_stream_holds_back_stop_prefixes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from serve.textstream import TextStream


def feed(stops: list[str], chunks: list[bytes]) -> tuple[list[str], str, bool]:
    ts = TextStream(stops)
    sent = [ts.push(c) for c in chunks]
    sent.append(ts.finish())
    return sent, "".join(sent), ts.stopped


def test_stop_prefix_is_held_back_until_resolved() -> None:
    ts = TextStream(["de"])
    assert [ts.push(b) for b in (b"b", b"c", b"d")] == ["b", "c", ""]  # d may start "de": held
    assert ts.push(b"e") == "" and ts.stopped  # "de" completed: never sent
    assert ts.push(b"f") == "" and ts.finish() == ""


def test_held_prefix_released_when_it_stops_matching() -> None:
    ts = TextStream(["de"])
    assert ts.push(b"d") == ""
    assert ts.push(b"x") == "dx"
    assert ts.push(b"d") == "" and ts.finish() == "d"  # end of generation: held text is sent


def test_utf8_split_across_tokens_waits_for_the_whole_character() -> None:
    euro = "€".encode()  # 3 bytes
    ts = TextStream()
    assert [ts.push(euro[i : i + 1]) for i in range(3)] == ["", "", "€"]
    assert ts.push(b"\xff") == "\ufffd"  # invalid byte: replacement character at once
    assert ts.push(euro[:2]) == "" and ts.finish() == "\ufffd"  # incomplete tail at the end


def test_stop_string_spanning_a_multibyte_character() -> None:
    sent, text, stopped = feed(["é!"], [b"a", "é".encode()[:1], "é".encode()[1:], b"!", b"z"])
    assert text == "a" and stopped and sent[:3] == ["a", "", ""]


def test_longest_held_prefix_over_several_stops() -> None:
    ts = TextStream(["abc", "bcd"])
    assert ts.push(b"xab") == "x"  # "ab" is a prefix of "abc"
    assert ts.push(b"c") == "" and ts.stopped


def test_earliest_stop_wins() -> None:
    assert feed(["cd", "b"], [b"abcd"])[1] == "a"


def reference(stops: list[str], data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


PIECES = [b"a", b"b", b"c", "é".encode()[:1], "é".encode()[1:], "€".encode(), b"\xff", b"ab"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=14),
    st.lists(st.sampled_from(["b", "ab", "ca", "é", "bc", "\ufffd"]), max_size=4),
)
def test_concatenation_equals_the_whole_text_cut_at_the_first_stop(chunks: list[bytes], stops: list[str]) -> None:
    sent, text, _ = feed(stops, chunks)
    assert text == reference(stops, b"".join(chunks))
    prefix = ""
    for piece in sent:  # nothing sent is ever the start of a stop string that later completes
        prefix += piece
        assert not any(s in prefix for s in stops)
