"""tl/text/grammar.py over the byte tokenizer of tests/helpers/models.py: compiling each kind of constraint, the
errors (each naming its field), the cache and its bound, the time bound, and the matcher's
bitmask rows (drafts included, state restored), checked against llguidance's own answers and
by hand."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from tests.helpers.fake_engine import byte_grammars
from tests.helpers.models import BYTE_VOCAB_SIZE, IM_END_ID, byte_tokenizer_json
from tests.helpers.structured import nested_any_of
from tl.core.config import EngineConfig
from tl.core.request import ConstraintSpec
from tl.text.grammar import GrammarCompiler, GrammarError, Matcher

pytestmark = pytest.mark.serial  # timing bounds: `make test` runs it alone, after the parallel part

CFG = EngineConfig(model_dir="unused")


def compiler(**kw: object) -> GrammarCompiler:
    return byte_grammars(CFG.replace(**kw))


def allowed(m: Matcher, vocab: int = BYTE_VOCAB_SIZE) -> set[int]:
    mask = np.zeros((1, (vocab + 31) // 32), np.int32)
    m.fill(mask, 0, ())
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]).tolist())


def feed(m: Matcher, text: str) -> None:
    for b in text.encode():
        assert m.accept(b), (text, b, m.error)


def json_spec(schema: object, param: str = "response_format.json_schema.schema") -> ConstraintSpec:
    return ConstraintSpec("json", json.dumps(schema), param)


def test_each_kind_allows_exactly_its_language() -> None:
    g = compiler()
    m = g.compile(ConstraintSpec("regex", "[ab]c", "structured_outputs.regex")).grammar.matcher()
    assert allowed(m) == {ord("a"), ord("b")}
    feed(m, "b")
    assert allowed(m) == {ord("c")} and not m.done
    feed(m, "c")
    assert m.done and allowed(m) == {IM_END_ID}  # complete: only EOS may follow

    m = g.compile(ConstraintSpec("choice", json.dumps(["yes", "no"]), "structured_outputs.choice")).grammar.matcher()
    assert allowed(m) == {ord("y"), ord("n")}
    feed(m, "no")
    assert m.done

    lark = 'start: "x" NUM\nNUM: /[0-9]+/'
    m = g.compile(ConstraintSpec("grammar", lark, "structured_outputs.grammar")).grammar.matcher()
    feed(m, "x12")
    assert not m.done and allowed(m) == {*range(ord("0"), ord("9") + 1), IM_END_ID}  # digits, or stop here
    assert m.accept(IM_END_ID) and m.done


def test_json_is_compact_and_exact() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"enum": ["ab", "cd"]}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    m = compiler().compile(json_spec(schema)).grammar.matcher()
    assert allowed(m) == {ord("{")}  # no leading whitespace
    feed(m, "{")
    assert allowed(m) == {ord('"')}  # no whitespace, no newline: the answer stays compact
    feed(m, '"n":12,"s":"')
    assert allowed(m) == {ord("a"), ord("c")}
    feed(m, 'cd"')
    assert allowed(m) == {ord("}")}
    feed(m, "}")
    assert m.done
    assert not m.accept(ord(" ")) and m.error  # past the end: the matcher's error state


def test_columns_past_the_tokenizer_stay_blocked() -> None:
    """A model vocabulary larger than the tokenizer's (padded embedding rows): those ids are never allowed."""
    g = GrammarCompiler(json.dumps(byte_tokenizer_json()), 320, (IM_END_ID,), 4, 5.0)
    m = g.compile(ConstraintSpec("regex", "[^x]*", "structured_outputs.regex")).grammar.matcher()
    ids = allowed(m, 320)
    assert max(ids) == IM_END_ID and ord("x") not in ids  # ids 259..319: blocked
    assert set(range(32, 127)) - ids == {ord("x")}
    assert g.mask_words == 10


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (json_spec({"type": "strin"}), "Invalid type: strin"),
        (json_spec({"type": "array", "uniqueItems": True}), "Unimplemented keys"),  # unsupported keyword
        (json_spec({"$ref": "#/$defs/x"}), "does not exist"),
        (json_spec({"type": "string", "pattern": "(["}), "unclosed character class"),
        (json_spec([1, 2]), "object"),
        (ConstraintSpec("json", "{not json", "structured_outputs.json"), ""),
        (ConstraintSpec("regex", "a(b", "structured_outputs.regex"), "unclosed group"),
        (ConstraintSpec("grammar", "start: foo", "structured_outputs.grammar"), 'unknown name: "foo"'),
    ],
)
def test_invalid_constraints_name_their_field_and_reason(spec: ConstraintSpec, reason: str) -> None:
    with pytest.raises(GrammarError) as e:
        compiler().compile(spec)
    assert e.value.param == spec.param
    assert str(e.value).startswith(spec.param + ": ") and reason in str(e.value)


def test_cache_hits_by_exact_spec_and_is_bounded() -> None:
    g = compiler(grammar_cache_size=2)
    specs = [ConstraintSpec("regex", f"a{{{i}}}", "p") for i in range(1, 4)]
    first = g.compile(specs[0])
    assert not first.cached and first.seconds > 0
    again = g.compile(specs[0])
    assert again.cached and again.grammar is first.grammar
    assert not g.compile(ConstraintSpec("regex", "a{1} ", "p")).cached  # another text: another grammar
    g.compile(specs[1])
    g.compile(specs[2])  # three newer entries: the first was evicted
    assert not g.compile(specs[0]).cached
    # a matcher per request: one sequence's progress never moves another's
    m1, m2 = first.grammar.matcher(), first.grammar.matcher()
    feed(m1, "a")
    assert m1.done and not m2.done


def test_refusals_are_cached_with_the_callers_field() -> None:
    g = compiler()
    bad = ConstraintSpec("regex", "a(b", "structured_outputs.regex")
    with pytest.raises(GrammarError):
        g.compile(bad)
    with pytest.raises(GrammarError) as e:
        g.compile(ConstraintSpec("regex", "a(b", "other.field"))
    assert e.value.param == "other.field" and "unclosed group" in str(e.value)


def test_a_compile_slower_than_the_bound_is_refused_and_stays_refused() -> None:
    g = compiler(grammar_timeout_s=0.01)
    spec = json_spec(nested_any_of(7))
    t0 = time.perf_counter()
    with pytest.raises(GrammarError) as e:
        g.compile(spec)
    assert time.perf_counter() - t0 > 0.01 and "grammar_timeout_s" in str(e.value)
    t0 = time.perf_counter()
    with pytest.raises(GrammarError):
        g.compile(spec)
    assert time.perf_counter() - t0 < 0.01  # remembered, not compiled again


def test_a_schema_past_the_resource_limits_is_refused() -> None:
    with pytest.raises(GrammarError) as e:
        compiler().compile(json_spec(nested_any_of(10)))
    assert "too large" in str(e.value) or "limit" in str(e.value)


def test_fill_with_drafts_gives_each_rows_mask_and_restores_the_state() -> None:
    m = compiler().compile(ConstraintSpec("regex", "(ab|ac)d", "p")).grammar.matcher()
    assert m.valid_prefix([ord("a"), ord("c"), ord("x")]) == 2
    mask = np.zeros((3, 9), np.int32)
    m.fill(mask, 0, (ord("a"), ord("c")))
    rows = [set(np.flatnonzero(np.unpackbits(r.view(np.uint8), bitorder="little")).tolist()) for r in mask]
    assert rows == [{ord("a")}, {ord("b"), ord("c")}, {ord("d")}]
    assert allowed(m) == {ord("a")}  # rolled back: nothing consumed


def test_compiles_run_without_the_gil() -> None:
    """Two slow compiles on two threads overlap (llguidance drops the GIL while it builds)."""
    g = compiler(grammar_timeout_s=60.0)
    specs = [json_spec({"x": i, **nested_any_of(6)}) for i in range(2)]
    t0 = time.perf_counter()
    g.compile(json_spec({"x": 9, **nested_any_of(6)}))
    one = time.perf_counter() - t0
    ticks = 0
    stop = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.perf_counter()
    for s in specs:
        g.compile(s)
    stop.set()
    ticker.join()
    elapsed = time.perf_counter() - t0
    assert ticks >= 0.3 * elapsed / 0.0011, (ticks, elapsed, one)  # the Python thread kept running


def test_fill_masks_in_parallel_equals_row_by_row() -> None:
    """A step's rows filled together (llguidance's executor, drafts included) equal each
    matcher's own fill, and leave every matcher where it was."""
    from tl.text.grammar import fill_masks

    g = compiler()
    specs = [ConstraintSpec("regex", r, "p") for r in ("(ab|ac)d+", "[0-9]{2,5}", "x|y|zz")]
    matchers = [g.compile(s).grammar.matcher() for s in specs]
    feed(matchers[1], "7")
    rows = [(matchers[0], 0, (ord("a"), ord("c"))), (matchers[1], 4, (ord("1"),)), (matchers[2], 6, ())]
    together = np.full((8, 9), -1, np.int32)
    fill_masks(together, rows)  # type: ignore[arg-type]  # Matchers are Guides
    alone = np.full((8, 9), -1, np.int32)
    for m, row, drafts in rows:
        m.fill(alone, row, drafts)
    np.testing.assert_array_equal(together, alone)
    assert (together[3] == -1).all() and (together[7] == -1).all()  # rows of no constrained work: untouched
    assert allowed(matchers[0]) == {ord("a")} and len(allowed(matchers[1])) == 10  # a second digit
