"""A pure-Python stand-in for tl.core.engine.Engine with hand-checkable outputs, for server tests.

The "succ" rule over a byte tokenizer: greedy next token = (last token + 1) % 256, so "a"
continues "bcd...". Under a structured-output constraint the successor is taken when the
grammar allows it, else the smallest allowed byte (`constrained`). Sampling (temperature > 0)
adds a seeded offset in 0..3. EOS is never produced unless `eos_token_ids` is set. Each
request reserves ceil((prompt + max_tokens) / block_size) blocks when admitted and returns
them when it finishes or is aborted, so /metrics can be checked exactly. `step_delay_s`
slows steps down for disconnect and drain tests; `fail_next_step` makes the next step raise.

FakeEngine has the members tl.core.async_engine.SyncEngine names, as tl.core.engine.Engine does, and
admits by the same rules (tl/core/request.py check_context and check_capacity).

Also: ByteTokenizer, ConcatTemplate (the seed's `{% for m in messages %}{{ m.content }}`),
`byte_model` (the ServedModel of tl/entry/served.py over them), `make_async_engine(cfg)` and
`make_real_async_engine(cfg)`, engine factories for serve.app's App (the AsyncEngine and its
ServedModel; tests/helpers/fake_app.py hands the latter to granian's App).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tests.helpers.fake_runner import pick_allowed
from tests.helpers.models import BYTE_VOCAB_SIZE, IM_END_ID, byte_tokenizer_json
from tl.core.async_engine import AsyncEngine
from tl.core.config import EngineConfig
from tl.core.plan import POOL_BITS, Overlapping, RunnerOutput, SchedulerOutput, SeqResult
from tl.core.request import EmbedRequest, GenRequest, Guide, TokenOut, check_capacity, check_context
from tl.core.stats import BackendInfo, EngineStats
from tl.entry.served import ChatRenderer, ServedModel
from tl.text.chat_template import ChatTemplate
from tl.text.grammar import GrammarCompiler
from tl.text.tools import FORMATS, ToolSetup, tool_template

EMBED_DIM = 8


def byte_grammars(cfg: EngineConfig) -> GrammarCompiler:
    """Structured output over the byte tokenizer of tests/helpers/models.py (ids 0..255 are the bytes; its
    EOS, <|im_end|>, is what a complete grammar allows)."""
    return GrammarCompiler(
        json.dumps(byte_tokenizer_json()), BYTE_VOCAB_SIZE, (IM_END_ID,), cfg.grammar_cache_size, cfg.grammar_timeout_s
    )


def byte_tools() -> ToolSetup:
    """Tool calling for the fake engines: SmolLM2's JSON-array form, tl's own tool template."""
    return ToolSetup(FORMATS["smollm2"], ChatTemplate(tool_template()), "tests: tl's tool template")


def constrained(guide: Guide, preferred: int) -> int:
    """The succ rule under a constraint: `preferred` if the grammar allows it, else the smallest
    allowed byte, else the smallest allowed id (EOS when the grammar is complete)."""
    mask = np.zeros((1, (BYTE_VOCAB_SIZE + 31) // 32), np.int32)
    guide.fill(mask, 0, ())
    return pick_allowed(mask[0], preferred, BYTE_VOCAB_SIZE)


class ByteTokenizer:
    vocab_size = 256
    special_token_ids: frozenset[int] = frozenset()

    def token_to_id(self, token: str) -> int | None:
        return None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # no BOS

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""  # a special id (a grammar's EOS) shows nothing


class ConcatTemplate:
    """Renders the content of every message, nothing else (the seed's succ template)."""

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        tools: object = None,
        **kwargs: object,
    ) -> str:
        return "".join(str(m.get("content") or "") for m in messages)


class RoleTemplate:
    """The seed's default template: <|role|>\\ncontent\\n per message, then <|assistant|>\\n."""

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        tools: object = None,
        **kwargs: object,
    ) -> str:
        text = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


def byte_model(
    cfg: EngineConfig,
    max_model_len: int,
    template: ChatRenderer | None = None,
    tools: ToolSetup | None = None,
    model_id: str | None = None,
) -> ServedModel:
    """What the fake engines serve: ByteTokenizer (its 256 ids the vocabulary), `template`
    (ConcatTemplate by default), `tools`, cfg's model id (or `model_id`) and max_logprobs."""
    return ServedModel(
        cfg.served_model_id() if model_id is None else model_id,
        max_model_len,
        ByteTokenizer.vocab_size,
        cfg.max_logprobs,
        ByteTokenizer(),
        template or ConcatTemplate(),
        tools,
    )


def fake_hidden(token_id: int, pos: int) -> list[float]:
    return [math.sin(0.1 * token_id * (k + 1) + 0.01 * pos) for k in range(EMBED_DIM)]


def fake_embedding(ids: Sequence[int]) -> list[float]:
    """The expected embedding: normalised mean of fake_hidden over the input, summed as the
    engine sums (each value in units of 2^-POOL_BITS, integers: tl/core/plan.py SeqResult)."""
    cols = zip(*(fake_hidden(t, p) for p, t in enumerate(ids)), strict=False)
    mean = [math.ldexp(sum(round(math.ldexp(v, POOL_BITS)) for v in col), -POOL_BITS) / len(ids) for col in cols]
    norm = math.sqrt(sum(x * x for x in mean))
    return [x / norm for x in mean]


class FakeRunner:
    def __init__(
        self,
        block_size: int = 4,
        num_kv_blocks: int = 256,
        max_model_len: int = 512,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.num_compilations = 0
        self.num_pending_compiles = 0
        self.closed = False
        self.warmed = False

    def close(self) -> None:
        self.closed = True

    def warmup(self) -> None:
        self.num_compilations = 3
        self.warmed = True

    def embed(self, token_ids: Sequence[int]) -> list[float]:
        return fake_embedding(token_ids)


@dataclass
class _Seq:
    rid: int
    req: GenRequest
    arrived: float
    rng: random.Random
    out: list[int] = field(default_factory=list)
    blocks: int = 0
    guide: Guide | None = None


class FakeEngine:
    def __init__(self, runner: FakeRunner, config: EngineConfig, step_delay_s: float = 0.0) -> None:
        self.runner = runner
        self.config = config
        self.max_model_len = runner.max_model_len
        self.eos_token_ids = runner.eos_token_ids
        self.backend_info: BackendInfo | None = None
        self.step_delay_s = step_delay_s
        self.fail_next_step = False
        self._next_id = 1
        self._waiting: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}
        self._aborted: list[int] = []
        self._free = runner.num_kv_blocks
        self._steps = 0
        self._batch_tokens = 0
        self._embeds: dict[int, tuple[int, ...]] = {}  # embeddings inputs, answered by the next step

    def check_context(self, req: GenRequest | EmbedRequest) -> None:
        check_context(req, self.max_model_len)

    def check_capacity(self, num_waiting: int) -> None:
        check_capacity(num_waiting, self.config.queue_capacity)

    def add_embedding(self, req: EmbedRequest) -> list[int]:
        self.check_context(req)
        self.check_capacity(len(self._waiting))
        ids = list(range(self._next_id, self._next_id + len(req.inputs)))
        self._next_id += len(req.inputs)
        self._embeds.update(zip(ids, req.inputs, strict=True))
        return ids

    def add_request(self, req: GenRequest) -> int:
        self.check_context(req)
        self.check_capacity(len(self._waiting))
        rid = self._next_id
        self._next_id += 1
        seed = req.params.seed if req.params.seed is not None else random.getrandbits(32)
        guide = req.constraint.matcher() if req.constraint is not None else None
        seq = _Seq(rid, req, time.monotonic(), random.Random(seed), guide=guide)
        self._waiting.append(seq)
        self._waiting = deque(sorted(self._waiting, key=lambda s: -s.req.priority))
        return rid

    def abort(self, request_id: int) -> None:
        if self._embeds.pop(request_id, None) is not None:
            self._aborted.append(request_id)
        for s in list(self._waiting):
            if s.rid == request_id:
                self._waiting.remove(s)
                self._aborted.append(request_id)
        s = self._running.pop(request_id, None)
        if s is not None:
            self._free += s.blocks
            self._aborted.append(request_id)

    def abort_all(self) -> None:
        for rid in [s.rid for s in self._waiting] + list(self._running) + list(self._embeds):
            self.abort(rid)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._aborted or self._embeds)

    def _blocks_for(self, s: _Seq) -> int:
        return -(-(len(s.req.prompt_ids) + s.req.params.max_tokens) // self.runner.block_size)

    def _admit(self, outs: list[TokenOut]) -> None:
        now = time.monotonic()
        deadline_s = self.config.queue_deadline_ms / 1000
        for s in list(self._waiting):
            if now - s.arrived > deadline_s:
                self._waiting.remove(s)
                outs.append(TokenOut(s.rid, -1, finish_reason="no_capacity"))
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            s = self._waiting[0]
            need = self._blocks_for(s)
            if need > self._free:
                break
            self._waiting.popleft()
            s.blocks = need
            self._free -= need
            self._running[s.rid] = s

    def step(self) -> list[TokenOut]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        self._steps += 1
        outs = [TokenOut(rid, -1, finish_reason="abort") for rid in self._aborted]
        self._aborted.clear()
        self._admit(outs)
        self._batch_tokens = 0
        for rid, ids in self._embeds.items():
            outs.append(TokenOut(rid, -1, finish_reason="stop", embedding=tuple(fake_embedding(ids))))
        self._embeds.clear()
        for s in list(self._running.values()):
            self._batch_tokens += 1 if s.out else len(s.req.prompt_ids)
            outs.append(self._next(s))
        return outs

    def _next(self, s: _Seq) -> TokenOut:
        p = s.req.params
        last = (s.out or list(s.req.prompt_ids))[-1]
        offset = 1 if p.greedy else 1 + s.rng.randrange(4)
        tok = (last + offset) % 256
        if s.guide is not None:
            tok = constrained(s.guide, tok)
        lp = 0.0 if p.greedy else math.log(0.25)
        s.out.append(tok)
        top = tuple(((tok + k) % 256, lp - 5.0 * k) for k in range(p.top_logprobs)) if p.logprobs else ()
        finish = None
        if s.guide is not None and not s.guide.accept(tok):
            del self._running[s.rid]
            self._free += s.blocks
            return TokenOut(s.rid, -1, finish_reason="error", error=f"matcher refused {tok}: {s.guide.error}")
        if s.guide is not None and s.guide.done:
            finish = "stop"
        elif tok in p.stop_token_ids or (tok in self.runner.eos_token_ids and not p.ignore_eos):
            finish = "stop"
        elif len(s.out) >= p.max_tokens or len(s.req.prompt_ids) + len(s.out) >= self.max_model_len:
            finish = "length"
        if finish is not None:
            del self._running[s.rid]
            self._free += s.blocks
        return TokenOut(s.rid, tok, lp, top, finish)  # type: ignore[arg-type]

    def close(self) -> None:
        self.runner.close()

    def stats(self) -> EngineStats:
        used = self.runner.num_kv_blocks - self._free
        return EngineStats(
            kv_blocks_free=self._free,
            kv_blocks_used=used,
            queue_depth=len(self._waiting),
            running=len(self._running),
            batch_tokens=self._batch_tokens,
            steps=self._steps,
            compilations=self.runner.num_compilations,
        )


def make_async_engine(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
    """An App's engine factory: FakeEngine. FAKE_STEP_DELAY_S, FAKE_TEMPLATE=concat|role and FAKE_MAX_LEN tune it."""
    runner = FakeRunner(max_model_len=int(os.environ.get("FAKE_MAX_LEN", "512")))
    engine = FakeEngine(runner, cfg, step_delay_s=float(os.environ.get("FAKE_STEP_DELAY_S", "0")))
    runner.warmup()
    template = RoleTemplate() if os.environ.get("FAKE_TEMPLATE") == "role" else ConcatTemplate()
    return AsyncEngine(engine, byte_grammars(cfg)), byte_model(cfg, engine.max_model_len, template, byte_tools())


class SuccRunner:
    """A Runner (tl/core/plan.py) with the pure succ rule, for the real tl.core.engine.Engine behind the server."""

    def __init__(
        self, block_size: int = 4, num_kv_blocks: int = 256, max_model_len: int = 512, step_delay_s: float = 0.0
    ) -> None:
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids: tuple[int, ...] = ()
        self.attention_window = 0
        self.backend_info: BackendInfo | None = None
        self.num_compilations = 0
        self.num_several_compilations = 0
        self.num_pending_compiles = 0
        self.overlap: Overlapping | None = None
        self.closed = False
        self.step_delay_s = step_delay_s

    def close(self) -> None:
        self.closed = True

    def decode_steps(self, num_seqs: int) -> int:
        return 1

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        results = []
        for w in plan.work:
            if w.pool:  # the chunk's sum of fake_hidden: the scheduler's mean is fake_embedding's
                cols = zip(*(fake_hidden(t, w.start_pos + i) for i, t in enumerate(w.token_ids)), strict=True)
                pooled = tuple(sum(round(math.ldexp(v, POOL_BITS)) for v in c) for c in cols)
                results.append(SeqResult(w.seq_id, (), (), pooled=pooled))
                continue
            if not w.sample:
                continue
            offset = 1 if w.params.greedy else 1 + random.Random(w.seed * 1_000_003 + w.num_generated).randrange(4)
            tok = (w.token_ids[-1] + offset) % 256
            if w.guide is not None:
                tok = constrained(w.guide, tok)
            lp = 0.0 if w.params.greedy else math.log(0.25)
            top = tuple(((tok + k) % 256, lp - 5.0 * k) for k in range(w.params.top_logprobs))
            results.append(SeqResult(w.seq_id, (tok,), (lp,), (top,) if w.params.logprobs else ()))
        return RunnerOutput(tuple(results))

    def embed(self, token_ids: Sequence[int]) -> list[float]:
        return fake_embedding(token_ids)


def make_real_async_engine(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
    """An App's engine factory: the real tl.core.engine.Engine over SuccRunner (FAKE_STEP_DELAY_S
    and FAKE_MAX_LEN apply)."""
    from tl.core.engine import Engine

    runner = SuccRunner(
        block_size=cfg.block_size,
        num_kv_blocks=min(cfg.num_kv_blocks, 256),
        max_model_len=int(os.environ.get("FAKE_MAX_LEN", "512")),
        step_delay_s=float(os.environ.get("FAKE_STEP_DELAY_S", "0")),
    )
    engine = Engine(runner, cfg)
    return AsyncEngine(engine, byte_grammars(cfg)), byte_model(cfg, engine.max_model_len, tools=byte_tools())


class ScriptEngine(FakeEngine):
    """A FakeEngine whose every answer is `script` (bytes), `per_step` tokens a step, then EOS
    (<|im_end|>): a tiny scripted model with a known output (a known tool call). A constraint's
    matcher is fed each token; a token it refuses ends the request with "error"."""

    def __init__(self, config: EngineConfig, script: bytes, per_step: int = 1) -> None:
        super().__init__(FakeRunner(num_kv_blocks=4096, max_model_len=8192, eos_token_ids=(IM_END_ID,)), config)
        self.script = script
        self.per_step = per_step

    def step(self) -> list[TokenOut]:
        self._steps += 1
        outs = [TokenOut(rid, -1, finish_reason="abort") for rid in self._aborted]
        self._aborted.clear()
        self._admit(outs)
        for s in list(self._running.values()):
            for _ in range(self.per_step):
                out = self._scripted(s)
                outs.append(out)
                if out.finish_reason is not None:
                    break
        return outs

    def _next_token(self, s: _Seq) -> int:
        """The script's token at s's position, then EOS (subclasses script per request)."""
        n = len(s.out)
        return self.script[n] if n < len(self.script) else IM_END_ID

    def _scripted(self, s: _Seq) -> TokenOut:
        tok = self._next_token(s)
        s.out.append(tok)
        finish = None
        if s.guide is not None and not s.guide.accept(tok):
            finish = "error"
        elif tok == IM_END_ID or (s.guide is not None and s.guide.done):
            finish = "stop"
        elif len(s.out) >= s.req.params.max_tokens:
            finish = "length"
        if finish is not None:
            del self._running[s.rid]
            self._free += s.blocks
        if finish == "error":
            return TokenOut(s.rid, -1, finish_reason="error", error=f"the script left the grammar at {tok}")
        return TokenOut(s.rid, tok, 0.0, (), finish)  # type: ignore[arg-type]


def make_script_async_engine(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
    """An App's engine factory: ScriptEngine answering FAKE_SCRIPT, FAKE_SCRIPT_PER_STEP tokens a step."""
    script = os.environ.get("FAKE_SCRIPT", "").encode()
    engine = ScriptEngine(cfg, script, int(os.environ.get("FAKE_SCRIPT_PER_STEP", "1")))
    return AsyncEngine(engine, byte_grammars(cfg)), byte_model(cfg, engine.max_model_len, tools=byte_tools())
