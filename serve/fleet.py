"""What the routers people run in front of replicas ask of a worker on the API port.

Owns the routers' probes: GET /health (200, empty body, while the engine serves; 503 while it
drains or after it failed, so vllm-router and SGLang's gateway stop sending to a replica before
its drain ends), GET /get_load (the engine's waiting and running load, in the shape the caller
parses: [engine] load_shape, since neither router says who it is in its headers), GET
/server_info and /model_info and their older names /get_server_info, /get_model_info (what SGLang's
gateway registers a worker with: the model id, its files, the context length, the parallelism),
and GET /metrics, the health port's document again where the Kubernetes Gateway API Inference
Extension's endpoint picker scrapes it (the pool's target port).
They need no API key, as on vLLM's and SGLang's servers: they say where to send work, never what
the model answers. Nothing here reaches the engine thread: the numbers come from the stats
snapshot /metrics reads. Tested in memory by tests/serve/test_fleet.py and behind the real
routers by tests/serve/test_routers.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msgspec import Struct

from serve import errors
from serve.asgi import Request, Sender
from serve.metrics import Metrics
from serve.wire import encoder
from tl.core.config import EngineConfig
from tl.core.stats import EngineStats
from tl.entry.served import ServedModel

PATHS = ("/health", "/get_load", "/server_info", "/model_info", "/get_server_info", "/get_model_info", "/metrics")


@dataclass(frozen=True, slots=True)
class Worker:
    """One replica as a router sees it, read when the probe arrives."""

    serving: bool  # ready, not draining, the engine alive
    failure: str | None  # why the engine stopped, if it did
    stats: EngineStats | None
    model: ServedModel | None
    config: EngineConfig
    metrics: Metrics


class VllmLoad(Struct, frozen=True):
    load: int  # requests waiting plus sequences running (vllm-router's power_of_two)


class SglangLoad(Struct, frozen=True):
    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int  # tokens whose KV the running sequences hold


def endpoint(path: str) -> str | None:
    """The metrics label of a router probe, None for any other path."""
    return path if path in PATHS else None


async def answer(req: Request, out: Sender, worker: Worker) -> None:
    if req.method != "GET":
        raise errors.method_not_allowed("GET")
    if req.path == "/health":
        if worker.failure is not None:
            raise errors.unavailable(worker.failure)
        if not worker.serving:
            raise errors.draining()
        await out.whole(200, b"")
        return
    if req.path == "/metrics":
        body, ctype = worker.metrics.render(req.headers.get("accept", ""))
        await out.whole(200, body, ctype.encode())
        return
    if req.path == "/get_load":
        await out.whole(200, encoder.encode(load(worker.stats or EngineStats(), worker.config)))
        return
    if worker.model is None:  # not served yet (granian answers only after the start-up; kept for safety)
        raise errors.draining()
    if req.path.endswith("server_info"):
        doc = server_info(worker.model, worker.config, worker.stats)
    else:
        doc = model_info(worker.model, worker.config)
    await out.whole(200, encoder.encode(doc))


def load(s: EngineStats, cfg: EngineConfig) -> VllmLoad | list[SglangLoad]:
    """The load in the shape cfg.load_shape names."""
    if cfg.load_shape == "sglang":
        return [SglangLoad(0, s.queue_depth + s.running, s.queue_depth, s.kv_blocks_used * cfg.block_size)]
    return VllmLoad(s.queue_depth + s.running)


def _files(cfg: EngineConfig) -> dict[str, Any]:
    """The model's files: SGLang's gateway loads the tokenizer from tokenizer_path when it is a
    directory it can read (a router on the same host), else goes on without it."""
    model = Path(cfg.model_dir).resolve()
    tokenizer = model if model.is_dir() and (model / "tokenizer.json").is_file() else None
    return {"model_path": str(model), "tokenizer_path": str(tokenizer) if tokenizer else None}


def server_info(model: ServedModel, cfg: EngineConfig, stats: EngineStats | None) -> dict[str, Any]:
    """max_total_num_tokens: the KV cache's blocks as the engine counts them (kv_cache_memory_gib
    may have sized them), else as configured."""
    counted = stats.kv_blocks_free + stats.kv_blocks_used + stats.kv_blocks_cached if stats else 0
    blocks = counted or cfg.num_kv_blocks
    return {
        **_files(cfg),
        "served_model_name": model.model_id,
        "context_length": model.max_model_len,
        "tp_size": cfg.tensor_parallel,
        "dp_size": 1,
        "page_size": cfg.block_size,
        "max_total_num_tokens": blocks * cfg.block_size,
        "max_running_requests": cfg.max_num_seqs,
        "disaggregation_mode": "null",
        "load_balance_method": "round_robin",
    }


def model_info(model: ServedModel, cfg: EngineConfig) -> dict[str, Any]:
    return {
        **_files(cfg),
        "served_model_name": model.model_id,
        "is_generation": True,
        "context_length": model.max_model_len,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }
