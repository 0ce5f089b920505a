"""Structured output through the real Engine and Scheduler over tests/helpers/fake_runner.py's FakeRunner
(the byte vocabulary of tests/helpers/models.py, its EOS <|im_end|>; the runner fills each constrained
row's bitmask from the sequence's matcher, as the compiled step gets it): valid, complete
answers; concurrency, n, seeds, chunked prefill, the prefix cache, preemption and prompt-lookup
speculation change nothing; a draft the grammar refuses is never verified; a matcher that fails
mid-way ends its request with "error", frees its blocks and leaves the engine serving."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema
import pytest

from tests.helpers.differential import (
    Arrival,
    assert_concurrent_equals_alone,
    drive,
    finish_reason,
    run_alone,
    token_ids,
)
from tests.helpers.fake_runner import FakeRunner
from tests.helpers.models import BYTE_VOCAB_SIZE, IM_END_ID
from tests.helpers.structured import CFG, SCHEMA, Failing, Trimmed, grammar
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.request import GenRequest, SamplingParams
from tl.text.grammar import Grammar


def factory(cfg: EngineConfig) -> FakeRunner:
    return FakeRunner.from_config(cfg, vocab_size=BYTE_VOCAB_SIZE, eos_token_ids=(IM_END_ID,))


def request(prompt: str, constraint: Any = None, **kw: Any) -> GenRequest:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 120, **kw})
    return GenRequest(tuple(prompt.encode()), params, constraint=constraint)


def text(outs: Sequence[Any]) -> str:
    return bytes(t for t in token_ids(outs) if t < 256).decode()


def test_a_constrained_answer_is_valid_json_and_finishes_with_stop() -> None:
    for prompt, kw in (("abc", {}), ("zz{", {"temperature": 1.0, "seed": 5}), ("q", {"temperature": 0.7, "seed": 9})):
        outs = run_alone(factory, CFG, request(prompt, grammar(), **kw))
        assert finish_reason(outs) == "stop", outs[-1]
        jsonschema.validate(json.loads(text(outs)), SCHEMA)
        assert " " not in text(outs) and "\n" not in text(outs)  # compact
        assert IM_END_ID not in token_ids(outs)  # complete on its last byte: no EOS step needed


def test_only_a_length_cut_leaves_a_truncated_document() -> None:
    outs = run_alone(factory, CFG, request("abc", grammar(), max_tokens=7))
    assert finish_reason(outs) == "length" and len(token_ids(outs)) == 7
    with pytest.raises(json.JSONDecodeError):
        json.loads(text(outs))


def test_an_unconstrained_request_beside_constrained_ones_is_untouched() -> None:
    plain = request("hello")
    alone = run_alone(factory, CFG, plain)
    engine = Engine(factory(CFG), CFG)
    outs = drive(engine, [Arrival(0, request("a", grammar())), Arrival(0, plain), Arrival(1, request("b", grammar()))])
    assert token_ids(outs[1]) == token_ids(alone)


CASES = {
    "concurrent": CFG,
    "preempting": CFG.replace(num_kv_blocks=48),
    "speculative": CFG.replace(speculative="prompt_lookup", num_speculative_tokens=4, prompt_lookup_min=1),
    "unchunked": CFG.replace(prefill_chunk=0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_requests_together_equal_alone(case: str) -> None:
    """Each request its own matcher: n choices, seeds, batch neighbours, preemption (resumed
    exactly) and drafts change no constrained answer."""
    cfg = CASES[case]
    prompts = ['{"id":12,"tag":"red"', "abcabcabc", "green blue red", "x" * 40, "0123456789" * 3]
    arrivals = [
        Arrival(i % 3, request(p, grammar(), temperature=t, seed=i))
        for i, (p, t) in enumerate((p, t) for p in prompts for t in (0.0, 1.0))
    ]
    arrivals.append(Arrival(2, request("ab", grammar("regex", "(ab){2,9}c"))))
    engine = assert_concurrent_equals_alone(factory, cfg, CFG, arrivals)
    assert engine.block_manager.num_used == 0
    if case == "preempting":
        assert engine.stats().preemptions > 0
    if case == "speculative":
        assert engine.stats().spec_drafts_accepted > 0


class Wrapped:
    def __init__(self, g: Grammar) -> None:
        self.g = g
        self.guides: list[Trimmed] = []

    def matcher(self) -> Trimmed:
        self.guides.append(Trimmed(self.g.matcher()))
        return self.guides[-1]


def test_drafts_the_grammar_refuses_are_never_verified() -> None:
    """The prompt repeats "abcd": prompt lookup drafts "d..." where the regex allows only a-c, so
    drafts are cut to their valid prefix before the step, and the answer equals plain decoding."""
    cfg = CASES["speculative"]
    wrapped = Wrapped(grammar("regex", "[abc]{30}"))
    outs = run_alone(factory, cfg, request("abcdabcdabcdabcd", wrapped))
    assert any(n < offered for offered, n in wrapped.guides[0].offered), wrapped.guides[0].offered
    plain = run_alone(factory, CFG, request("abcdabcdabcdabcd", grammar("regex", "[abc]{30}")))
    assert token_ids(outs) == token_ids(plain) and finish_reason(outs) == "stop" and len(text(outs)) == 30


def test_a_matcher_error_ends_its_request_frees_its_blocks_and_the_engine_serves_on() -> None:
    engine = Engine(factory(CFG), CFG)
    outs = drive(engine, [Arrival(0, request("abc", Failing(4))), Arrival(0, request("abc"))])
    failed = outs[0]
    assert failed[-1].finish_reason == "error" and failed[-1].token_id == -1
    assert "injected" in failed[-1].error and "refused token" in failed[-1].error
    assert len(token_ids(failed)) == 3  # the refused token is not delivered
    assert token_ids(outs[1]) == token_ids(run_alone(factory, CFG, request("abc")))
    assert engine.block_manager.num_used == 0 and not engine.has_work()
    after = drive(engine, [Arrival(0, request("abc", grammar("regex", "[a-z]{5}")))])[0]
    assert finish_reason(after) == "stop" and len(text(after)) == 5


def test_the_prefix_cache_serves_a_constrained_prompt() -> None:
    engine = Engine(factory(CFG), CFG)
    prompt = "shared prefix of a few blocks: " * 2
    first = drive(engine, [Arrival(0, request(prompt, grammar()))])[0]
    second = drive(engine, [Arrival(0, request(prompt, grammar()))])[0]
    assert engine.stats().prefix_cache_hits > 0
    assert token_ids(first) == token_ids(second)
