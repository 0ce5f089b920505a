"""Engine configuration: the `[engine]` table of runtime.toml as one frozen dataclass.

Owns: every tunable of the runner, scheduler and server, its default and its bounds.
Reads no environment variables and no files itself: serve/config_load.py `load_config`
turns TOML plus `TL_ENGINE__*` overrides into keyword arguments for `EngineConfig`, and
what the library needs from the machine (the native build cache, its compiler) comes in
as keys here, never from the environment deep in the library.
Must not import jax. Tested by tests/core/test_config.py.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

PrefixCache = Literal["none", "radix"]
Speculative = Literal["none", "prompt_lookup"]
DType = Literal["auto", "float32", "bfloat16"]
WeightDType = Literal["auto", "float32", "int8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16"]
"""The configured weight_dtype (tl/model/loader.py `EncodingName` is any encoding loading makes)."""
KVCacheDType = Literal["auto", "bfloat16", "float32"]
MatmulPrecision = Literal["highest", "high"]
WeightPages = Literal["huge", "default"]
WeightLayout = Literal["auto", "stored", "panels"]
Backend = Literal["auto", "cpu", "gpu", "tpu"]
ToolParser = Literal["auto", "hermes", "smollm2"]
ReasoningParser = Literal["auto", "none", "think"]
Overlap = Literal["auto", "on", "off"]
LoadShape = Literal["vllm", "sglang"]
AttentionKernel = Literal["auto", "reference", "cpu_native", "pallas_tpu", "pallas_gpu"]
MatmulKernel = Literal["auto", "xla", "cpu_native"]
NativeTarget = Literal[
    "auto", "x86-64", "x86-64-v3", "x86-64-v4", "x86-64-v4-vnni", "sapphirerapids", "aarch64", "aarch64-dotprod"
]


class ConfigError(ValueError):
    """A configuration value is out of range or unknown; the message names it."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every `[engine]` key. Field docstrings are the README's reference."""

    model_dir: str = "artifacts/models/smol-135m"
    """Hugging Face style model directory (config.json, safetensors, tokenizer.json; `tl pull`
    keeps the GGUF there too, as model.gguf), or a llama.cpp `.gguf` file, served as it is: its side
    files (config, tokenizer, generation config) are written once per file (keyed by path, size and
    mtime) into a directory named after the file's stem, beside a link to the file, under
    ~/.cache/tl/gguf."""
    model_id: str = ""
    """Name served in /v1/models and accepted in `model`; empty means the directory name (for a
    `.gguf` file: its stem, e.g. `SmolLM2-135M-Instruct.Q4_1`)."""
    backend: Backend = "auto"
    """JAX platform: "auto" picks the best present (tpu, then gpu, then cpu)."""
    dtype: DType = "auto"
    """Weight and activation dtype; "auto" is float32 on CPU (bf16 is far slower there), bfloat16 on GPU/TPU."""
    weight_dtype: WeightDType = "auto"
    """Linear and embedding weights. "auto": as the model's files store them: a GGUF's block
    formats kept packed (a `.gguf` model_dir, or the model.gguf `tl pull` keeps), else as `dtype`.
    "float32": as `dtype` (a GGUF dequantized; a directory with safetensors reads those).
    "int8": per-output-channel scales, int8 dots. "q8_0", "q4_0", "q4_1", "q5_0", "q5_1":
    llama.cpp's block formats, quantized at load from the float weights (32 inputs a block; input
    widths must be multiples of 32); integer dots on CPU. "f16", "bf16": 2 bytes a weight (a GGUF's
    F16 / BF16 matrices are kept so under "auto"), widened to float32 as they are read."""
    kv_cache_dtype: KVCacheDType = "auto"
    """KV cache storage: "auto" is `dtype`; "bfloat16" halves the cache of a float32 model (twice the
    blocks in the same memory, half the bytes attention reads; keys and values rounded to bf16;
    not batch invariant yet: README, "Same request, same answer"); "float32" asks for a float32
    cache (a float32 model only)."""
    matmul_precision: MatmulPrecision = "high"
    """Float32 matmuls on CPU: "high" splits each operand into two bf16 and sums three bf16 products
    in float32 on AMX (JAX's bfloat16_3x, PyTorch's "high"; ~1e-5 relative error a product) where
    the CPU has AMX-BF16, else runs as "highest": float32 multiply-adds throughout."""
    weight_pages: WeightPages = "huge"
    """CPU backend, one device: "huge" puts the weights in one host mapping advised for transparent
    huge pages (madvise), read by XLA without a copy; a one-row decode step streams every weight,
    and 2 MiB pages spare it a page walk every 4 KiB (+3-5% one-stream decode here). "default":
    XLA's own buffers. Ignored where THP is "never", on GPU/TPU and under tensor parallelism."""
    weight_layout: WeightLayout = "auto"
    """Where a model's q8_0, q4_0 and q4_1 matrices lie in memory for the native CPU kernels:
    "panels" repacks them at load, 16 outputs a panel with the outputs in the vector lanes (the
    same bytes and results, bit for bit; one-row matmuls spend a quarter of the instructions),
    "stored" keeps the GGUF's rows. "auto" is "panels" where the layer matmuls run the native
    kernels of a build that has the panel kernels (AVX-512 VNNI) on one device, else "stored"."""
    tensor_parallel: int = 1
    """Devices the model is sharded over (Megatron layout on the mesh's "model" axis)."""
    attention_kernel: AttentionKernel = "auto"
    """Paged attention: "auto" picks the Pallas kernel on TPU/GPU; on CPU the native kernel where the
    library builds (not timed: its rows do not depend on their step, the jnp reference's do);
    "cpu_native" forces the native kernel at every shape, "reference" the jnp one."""
    matmul_kernel: MatmulKernel = "auto"
    """CPU matmuls (and the sampler's argmax): "auto" takes the native kernels at every row count
    where they measured faster than XLA's dot on the model (timed at start-up per row class, cached
    per CPU), else XLA's at every one; "cpu_native" forces them, "xla" never uses them."""
    native_target: NativeTarget = "auto"
    """Which build of the native CPU kernels: "auto" is the most capable this CPU runs
    (sapphirerapids with AMX, x86-64-v4-vnni with AVX-512 VNNI+BF16, x86-64-v4 with AVX-512,
    x86-64-v3 with AVX2+FMA, x86-64 with SSE2, aarch64-dotprod with NEON+SDOT, aarch64 with NEON);
    naming one this CPU runs forces it (e.g. AVX2 code on an AVX-512 machine)."""
    native_cache_dir: str = ""
    """Where the native CPU kernels are built and cached, one library per target and source
    version; empty means ~/.cache/tl/native."""
    native_cxx: str = ""
    """The C++ compiler that builds the native CPU kernels; empty means g++, else c++. One that
    is missing or fails leaves the jnp reference and XLA's dots, the start-up log says why."""
    coordinator_address: str = ""
    """Multi-host: jax.distributed coordinator host:port; empty means JAX_COORDINATOR_ADDRESS or single host."""
    num_processes: int = 0
    """Multi-host: processes in the job; 0 means JAX_NUM_PROCESSES or auto-detection."""
    process_id: int = -1
    """Multi-host: this process's index; -1 means JAX_PROCESS_ID or auto-detection. Serving needs it
    known before start-up (config or JAX_PROCESS_ID): process 0 serves the API, the others follow."""
    step_port: int = 0
    """Multi-host: the TCP port process 0 sends each step's inputs on (followers connect to the
    coordinator's host); 0 means the coordinator's port + 1."""
    peer_timeout_s: float = 10.0
    """Multi-host: a process of the group silent this long (no step, no heartbeat), or a step whose
    collectives have not returned this long, fails the group: process 0 stops admitting (readyz 503),
    fails in-flight requests with 503 and every process exits non-zero."""
    group_start_timeout_s: float = 300.0
    """Multi-host: how long start-up waits for the rest of the group (followers compile at start-up
    too): the leader for every follower to connect and jax.distributed to form, then, once its own
    model is compiled, for every follower to report ready; a follower for the leader's step channel
    and jax.distributed. On expiry one ERROR line names the missing process ids and the process
    exits with status 4 (the leader's granian then with 1)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int = 2048
    """KV-cache blocks preallocated on the device (SmolLM2: 720 KiB per block in float32, 360 KiB in bf16)."""
    kv_cache_memory_gib: float = 0.0
    """When > 0, the KV cache's size in GiB instead: num_kv_blocks becomes as many blocks as it holds
    (keys and values of every layer in the cache's format, the runner's scratch block included),
    whatever num_kv_blocks says (tl/runtime/kv_size.py)."""
    max_model_len: int = 0
    """Context length (prompt + output); 0 means the model's max_position_embeddings."""
    max_num_seqs: int = 64
    """Most sequences in one step."""
    max_num_batched_tokens: int = 512
    """Token budget of one step (prefill chunks + decodes + drafts)."""
    prefill_chunk: int = 512
    """Longest piece of one prompt computed in one step; 0 disables chunking."""
    prompt_tokens_while_decoding: int = 128
    """Most prompt tokens (prefill chunks, embeddings inputs) a step carries beside decodes, so that
    every running stream keeps its cadence (as prompt_ms_while_decoding, to prompts that arrived
    while a stream of the step was streaming); 0: only max_num_batched_tokens bounds them."""
    prompt_ms_while_decoding: float = 100.0
    """The same cadence bound in time, whatever the model's size: a step that carries decodes takes
    prompt work only up to the token bucket whose measured step time (tl/core/step_costs.py) stays
    within the decodes' own step time plus this many milliseconds, and always at least up to the
    next bucket above the decodes (so prompts progress); both bounds apply, to prompts that arrived
    while a stream of the step was already streaming (not to the rest of a burst: the scheduler's
    docstring). 0: no time bound."""
    token_buckets: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128, 256, 512)
    """Padded token counts of the compiled step, ascending; the last >= max_num_batched_tokens."""
    seq_buckets: tuple[int, ...] = (1, 4, 16, 64)
    """Padded sequence counts of the compiled step, ascending; the last >= max_num_seqs."""
    prefix_cache: PrefixCache = "radix"
    """Reuse cached full KV blocks of earlier prompts ("radix") or not ("none")."""
    speculative: Speculative = "none"
    """Speculative decoding: "prompt_lookup" drafts from n-gram matches in the request."""
    num_speculative_tokens: int = 4
    """Most draft tokens verified per sequence per step."""
    prompt_lookup_min: int = 2
    """Shortest n-gram that prompt lookup matches."""
    prompt_lookup_max: int = 4
    """Longest n-gram that prompt lookup tries first."""
    decode_steps: int = 4
    """Most decode steps run in one compiled call when every row of a step is a plain decode (no
    constraint, draft, top logprobs or waiting prompt); 1: one step per call."""
    decode_steps_max_ms: float = 50.0
    """The bound on such a call: its steps times the last measured time of one decode step stay
    within it, so an arriving prompt or an abort waits at most this long for the call to end."""
    overlap: Overlap = "auto"
    """"on": launch the next call after a step of plain decodes before that step's tokens reach
    the host (their last tokens fed in on the device, waiting prompts admitted beside them), and
    fold its results in (stops, stop strings, aborts, finishes: one call late, the next call's
    work for a finished row dropped), deliver them and schedule while the device computes. "off":
    every step synchronous. "auto": on where the runner says it pays (an accelerator; not a CPU
    backend, whose steps run on the same cores as the host's work: measured no faster there)."""
    max_logprobs: int = 20
    """Most `top_logprobs` a request may ask for."""
    tool_parser: ToolParser = "auto"
    """How tool calls are written and parsed: "auto" detects it from the chat template (Hermes
    blocks where the template writes <tool_call>; else SmolLM2's JSON array with tl's own tool
    template), or "hermes" / "smollm2"."""
    reasoning_parser: ReasoningParser = "auto"
    """Whether answers are split into thinking (<think>...</think>) and answer: "auto" when the
    vocabulary holds <think> and </think> as single tokens (a template that merely writes <think>
    is not enough); "think": always (both must be single tokens, else start-up fails); "none":
    never (the markers stay in the text)."""
    thinking_token_budget: int = -1
    """Most tokens a reasoning model may think before </think> is forced, for requests that set no
    budget of their own; -1: no limit."""
    grammar_timeout_s: float = 5.0
    """Longest a structured-output constraint may take to compile; a slower one is a 400."""
    grammar_cache_size: int = 128
    """Compiled constraints kept (LRU, by the exact schema, regex or grammar text)."""
    responses_store_size: int = 1000
    """Responses (/v1/responses with store) kept per replica for previous_response_id and GET;
    the least recently used goes first."""
    responses_store_ttl_s: float = 3600.0
    """Longest a stored response is kept."""
    queue_capacity: int = 256
    """Requests waiting for admission; one more is refused (HTTP 429)."""
    queue_deadline_ms: int = 30_000
    """A request still waiting for KV blocks this long finishes with no_capacity (HTTP 503)."""
    http_listen: str = "127.0.0.1:8000"
    """API address host:port."""
    health_listen: str = "127.0.0.1:9464"
    """Health and metrics address host:port."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may run before they are aborted."""
    drain_min_s: float = 0.0
    """On SIGTERM, the lame-duck window: for this long GET /health and /readyz answer 503 while new
    requests are still served, so a router or load balancer polling them (every `interval` s, down
    after `threshold` failures) stops sending before the server refuses anything; then the drain
    proper (new requests 503). Within drain_timeout_s, which bounds the whole stop."""
    load_shape: LoadShape = "vllm"
    """GET /get_load's document (serve/fleet.py): "vllm", {"load": waiting + running} as
    vllm-router's power_of_two reads it; "sglang", [{"dp_rank": 0, "num_tokens": ...}] as SGLang's
    gateway reads it. Routers send no header that tells them apart."""
    kv_events_endpoint: str = ""
    """A ZMQ address (tcp://HOST:PORT) where the prefix cache's events are published in vLLM's
    format, for vllm-router's kv_aware policy (tl/runtime/kv_publisher.py); empty: none. Needs
    prefix_cache = "radix" and the pyzmq package."""
    kv_events_replay_endpoint: str = ""
    """Where a router that missed events asks for them again (a ZMQ ROUTER socket); empty: none."""
    kv_events_topic: str = ""
    """The topic frame of every event message."""
    api_keys: tuple[str, ...] = ()
    """If not empty, /v1/* (and /tokenize, /detokenize, /openapi.json) needs `Authorization: Bearer
    <key>` with one of these; /healthz, the routers' probes and the chat page need none."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body accepted (HTTP 413 above)."""
    compile_cache_dir: str = "artifacts/jax-cache"
    """JAX persistent compilation cache; empty disables it."""

    def __post_init__(self) -> None:
        for name, choices in _literal_choices().items():  # every Literal-typed key, from its type
            value = getattr(self, name)
            _check(value in choices, f"{name} must be {_either(choices)}, got {value!r}")
        _check(self.tensor_parallel >= 1, f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        _check(self.num_processes >= 0, f"num_processes must be >= 0, got {self.num_processes}")
        _check(self.process_id >= -1, f"process_id must be >= -1, got {self.process_id}")
        _check(0 <= self.step_port < 65536, f"step_port must be in 0..65535, got {self.step_port}")
        _check(self.peer_timeout_s > 0, f"peer_timeout_s must be > 0, got {self.peer_timeout_s}")
        _check(self.group_start_timeout_s > 0, f"group_start_timeout_s must be > 0, got {self.group_start_timeout_s}")
        _check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two <= 128, got {self.block_size}",
        )
        _check(self.num_kv_blocks >= 2, f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        _check(self.kv_cache_memory_gib >= 0, f"kv_cache_memory_gib must be >= 0, got {self.kv_cache_memory_gib}")
        _check(
            not self.kv_events_endpoint or self.prefix_cache == "radix",
            'kv_events_endpoint needs prefix_cache = "radix": the events are the prefix cache\'s',
        )
        _check(
            not self.kv_events_replay_endpoint or bool(self.kv_events_endpoint),
            "kv_events_replay_endpoint needs kv_events_endpoint",
        )
        _check(self.max_model_len >= 0, f"max_model_len must be >= 0, got {self.max_model_len}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
        )
        _check(self.prefill_chunk >= 0, f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
        _check(
            self.prompt_tokens_while_decoding >= 0,
            f"prompt_tokens_while_decoding must be >= 0, got {self.prompt_tokens_while_decoding}",
        )
        _check(
            self.prompt_ms_while_decoding >= 0,
            f"prompt_ms_while_decoding must be >= 0, got {self.prompt_ms_while_decoding}",
        )
        for name in ("token_buckets", "seq_buckets"):
            b = getattr(self, name)
            _check(
                len(b) > 0 and all(isinstance(x, int) and x > 0 for x in b),
                f"{name} must be positive integers, got {b!r}",
            )
            _check(list(b) == sorted(set(b)), f"{name} must be strictly ascending, got {b!r}")
        _check(
            self.token_buckets[-1] >= self.max_num_batched_tokens,
            f"largest token bucket {self.token_buckets[-1]} < max_num_batched_tokens {self.max_num_batched_tokens}",
        )
        _check(
            self.seq_buckets[-1] >= self.max_num_seqs,
            f"largest seq bucket {self.seq_buckets[-1]} < max_num_seqs {self.max_num_seqs}",
        )
        _check(
            self.max_num_batched_tokens >= self.max_num_seqs * (1 + self.spec_tokens),
            f"max_num_batched_tokens {self.max_num_batched_tokens} must cover max_num_seqs {self.max_num_seqs}"
            f" x (1 + {self.spec_tokens} draft tokens)",
        )
        _check(
            1 <= self.num_speculative_tokens <= 16,
            f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}",
        )
        _check(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, {self.prompt_lookup_max}",
        )
        _check(0 <= self.max_logprobs <= 20, f"max_logprobs must be in 0..20, got {self.max_logprobs}")
        _check(1 <= self.decode_steps <= 64, f"decode_steps must be in 1..64, got {self.decode_steps}")
        _check(self.decode_steps_max_ms > 0, f"decode_steps_max_ms must be > 0, got {self.decode_steps_max_ms}")
        _check(
            self.thinking_token_budget >= -1,
            f"thinking_token_budget must be >= 0 (or -1: no limit), got {self.thinking_token_budget}",
        )
        _check(self.grammar_timeout_s > 0, f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s}")
        _check(self.grammar_cache_size >= 1, f"grammar_cache_size must be >= 1, got {self.grammar_cache_size}")
        _check(self.responses_store_size >= 1, f"responses_store_size must be >= 1, got {self.responses_store_size}")
        _check(self.responses_store_ttl_s > 0, f"responses_store_ttl_s must be > 0, got {self.responses_store_ttl_s}")
        _check(self.queue_capacity >= 1, f"queue_capacity must be >= 1, got {self.queue_capacity}")
        _check(self.queue_deadline_ms >= 1, f"queue_deadline_ms must be >= 1, got {self.queue_deadline_ms}")
        _check(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        _check(
            0 <= self.drain_min_s <= self.drain_timeout_s,
            f"drain_min_s must be in 0..drain_timeout_s ({self.drain_timeout_s}), got {self.drain_min_s}",
        )
        _check(self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")

    @property
    def spec_tokens(self) -> int:
        """Draft tokens per sequence per step: 0 when speculative decoding is off."""
        return 0 if self.speculative == "none" else self.num_speculative_tokens

    def served_model_id(self) -> str:
        import os.path

        return self.model_id or os.path.basename(os.path.normpath(self.model_dir))

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]  # keys and types checked by __post_init__


@functools.cache
def _literal_choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of each Literal-typed key, read from its annotation."""
    hints = typing.get_type_hints(EngineConfig)
    return {name: typing.get_args(t) for name, t in hints.items() if typing.get_origin(t) is Literal}


def _either(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def engine_keys() -> dict[str, dataclasses.Field[object]]:
    """The `[engine]` keys a config file may set, by name."""
    return {f.name: f for f in dataclasses.fields(EngineConfig)}


@dataclass(frozen=True, slots=True)
class Group:
    """A multi-host job as this process knows it at start (config, then JAX_* variables): what
    jax.distributed.initialize is given. Unknowns are left to jax's cluster auto-detection (TPU
    pods, SLURM, Open MPI, Kubernetes), which is how TPU pods and GPU clusters usually start."""

    coordinator_address: str = ""  # "": unknown
    num_processes: int = 0  # 0: unknown
    process_id: int = -1  # -1: unknown

    def jax_args(self) -> dict[str, Any]:
        """jax.distributed.initialize keywords: the known values only."""
        args: dict[str, Any] = {}
        if self.coordinator_address:
            args["coordinator_address"] = self.coordinator_address
        if self.num_processes:
            args["num_processes"] = self.num_processes
        if self.process_id >= 0:
            args["process_id"] = self.process_id
        return args


def multihost_group(cfg: EngineConfig, env: Mapping[str, str]) -> Group | None:
    """The multi-host job this process belongs to; None for one host. Multi-host is on when a
    coordinator address is known or num_processes > 1 (config or JAX_NUM_PROCESSES)."""
    address = cfg.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS", "")
    num = cfg.num_processes or int(env.get("JAX_NUM_PROCESSES", "0") or 0)
    pid = cfg.process_id if cfg.process_id >= 0 else int(env.get("JAX_PROCESS_ID", "-1") or -1)
    if not address and num <= 1:
        return None
    return Group(address, num, pid)
