"""A tiny scripted reasoning model for the server tests: the byte tokenizer of tests/helpers/models.py with
`<think>` (259) and `</think>` (260) added as special tokens, a Qwen3-like chat template, and
ThinkEngine, whose answer is a script chosen from the prompt.

Scripts (the last user turn names one; the template's end of prompt decides first):
thinking turned off (the prompt ends with an empty think block): an answer only; thinking
opened by the template (`open_think`): thinking without `<think>`, then `</think>`; "json": a
thought, then a JSON object; "tool": a thought, then a call; "long": a long thought (for a
budget); "bytes": the markers written byte by byte (not as their tokens); else a short thought
and an answer. A token the request's guide refuses is replaced by the one token it allows (the
budget's forced `</think>`: the script then goes on after its own `</think>`), else the request
ends with "error". Used by tests/text/test_reasoning.py and tests/helpers/fake_app.py's `think_app`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np

from tests.helpers.fake_engine import ScriptEngine, _Seq, byte_tools
from tests.helpers.models import IM_END_ID, SPECIAL_TOKENS, byte_tokenizer_json
from tl.core.async_engine import AsyncEngine
from tl.core.config import EngineConfig
from tl.core.request import GenRequest, Guide
from tl.entry.served import ServedModel
from tl.text.chat_template import ChatTemplate
from tl.text.grammar import GrammarCompiler
from tl.text.reasoning import setup

SPECIALS = (*SPECIAL_TOKENS, "<think>", "</think>")
THINK_ID, END_ID = 259, 260
VOCAB = 256 + len(SPECIALS)

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined and open_think %}<think>\n{% endif %}{% endif %}"
)
"""Qwen3's shape: a replayed thought in <think>; enable_thinking false closes an empty one."""

SCRIPTS = {
    "off": "The answer without thinking.",
    "open": "Thinking that the template opened.\n</think>\n\nAnswer after an opened thought.",
    "json": '<think>\nThe user wants JSON.\n</think>{"city":"Paris"}',
    "tool": "<think>\nA call is needed.\n</think>"
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>',
    "long": "<think>\n" + "step " * 40 + "\n</think>\n\nDone thinking.",
    "plain": '<think>\nLet me think about "a".\n</think>\n\nThe answer is b.',
}


class ThinkTokenizer:
    """Bytes are ids 0..255; the special tokens' texts are one token each (ids 256..260)."""

    vocab_size = VOCAB
    special_token_ids = frozenset(range(256, VOCAB))

    def token_to_id(self, token: str) -> int | None:
        return 256 + SPECIALS.index(token) if token in SPECIALS else None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        while text:
            hit = next((s for s in SPECIALS if text.startswith(s)), None)
            if hit is not None:
                ids.append(256 + SPECIALS.index(hit))
                text = text[len(hit) :]
            else:
                ids += list(text[0].encode())
                text = text[1:]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # no BOS

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        return SPECIALS[token_id - 256].encode() if token_id < VOCAB else b""


TOKENIZER = ThinkTokenizer()


def script_for(prompt: str) -> list[int]:
    """The answer's token ids for a rendered prompt."""
    if prompt.endswith("</think>\n\n"):
        return TOKENIZER.encode(SCRIPTS["off"])
    if prompt.endswith("<think>\n"):
        return TOKENIZER.encode(SCRIPTS["open"])
    last = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "bytes" in last:
        return list(SCRIPTS["plain"].encode())  # the markers as plain bytes, 7 and 8 tokens
    key = next((k for k in ("json", "tool", "long") if k in last), "plain")
    return TOKENIZER.encode(SCRIPTS[key])


def allowed(guide: Guide) -> list[int]:
    mask = np.zeros((1, (VOCAB + 31) // 32), np.int32)
    guide.fill(mask, 0, ())
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB]
    return [int(i) for i in np.flatnonzero(bits)]


class ThinkEngine(ScriptEngine):
    """ScriptEngine scripted per request from its prompt (`script_for`); a guide that allows one
    token only (the thinking budget's forced </think>) gets it, and the script then skips to the
    answer after its own </think>."""

    def __init__(self, config: EngineConfig, per_step: int = 3) -> None:
        super().__init__(config, b"", per_step)
        self.scripts: dict[int, list[int]] = {}
        self.prompts: list[str] = []  # every rendered prompt, in order

    def add_request(self, req: GenRequest) -> int:
        rid = super().add_request(req)
        prompt = TOKENIZER.decode(req.prompt_ids)
        self.prompts.append(prompt)
        self.scripts[rid] = script_for(prompt)
        return rid

    def _next_token(self, s: _Seq) -> int:
        script = self.scripts[s.rid]
        pos = len(s.out)
        tok = script[pos] if pos < len(script) else IM_END_ID
        if s.guide is not None:
            ok = allowed(s.guide)
            if tok not in ok and len(ok) == 1:  # forced (the thinking budget's </think>)
                tok = ok[0]
                if tok == END_ID and END_ID in script:  # the model goes on after its thought
                    del script[pos : script.index(END_ID)]
        return tok


def think_grammars(cfg: EngineConfig) -> GrammarCompiler:
    return GrammarCompiler(
        json.dumps(byte_tokenizer_json(SPECIALS)), VOCAB, (IM_END_ID,), cfg.grammar_cache_size, cfg.grammar_timeout_s
    )


def think_model(cfg: EngineConfig, max_model_len: int) -> ServedModel:
    """The ServedModel of the think vocabulary: reasoning as `[engine] reasoning_parser` says."""
    reasoning = setup(cfg.reasoning_parser, TEMPLATE, TOKENIZER)
    budget = None if cfg.thinking_token_budget < 0 else cfg.thinking_token_budget
    return ServedModel(
        "think",
        max_model_len,
        VOCAB,
        cfg.max_logprobs,
        TOKENIZER,
        ChatTemplate(TEMPLATE),
        byte_tools(),
        reasoning.markers,
        budget,
    )


def make_think_async_engine(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
    """An App's engine factory: ThinkEngine, 3 tokens a step."""
    engine = ThinkEngine(cfg)
    return AsyncEngine(engine, think_grammars(cfg)), think_model(cfg, engine.max_model_len)
