"""The soak and fault suite (bench/soak.py), short: seconds of each scenario against a real
granian server on the tiny random model, loopback only, so a regression shows in CI.

One server takes the mixed load then the disconnect storm; a second one SIGTERM under 64
streams; a third, with a KV cache a tenth of the demand, the exhaustion check. Every check a
scenario makes must pass (the full run is `python -m bench soak --minutes 30`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench import soak
from tests.helpers.models import make_tiny_llama

# Small buckets: every step variant is compiled at start-up.
ENGINE = (
    "block_size = 4\nnum_kv_blocks = 512\nmax_num_seqs = 16\nmax_num_batched_tokens = 64\n"
    "prefill_chunk = 64\nprompt_tokens_while_decoding = 32\ntoken_buckets = [16, 64]\nseq_buckets = [4, 16]\n"
    'max_model_len = 512\nattention_kernel = "reference"\nmatmul_kernel = "xla"\ncompile_cache_dir = ""\n'
    "queue_capacity = 256\ndrain_timeout_s = 30\n"
)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("soak")
    model = make_tiny_llama(d / "tiny")
    path = d / "runtime.toml"
    path.write_text(f'[engine]\nmodel_dir = "{model}"\nmodel_id = "tiny"\n{ENGINE}')
    return str(path)


def _assert_ok(rep: soak.Report) -> None:
    assert rep.ok, "\n".join(f"{c.name}: {'ok' if c.ok else 'FAILED'} ({c.detail})" for c in rep.checks)


def test_mixed_load_then_a_disconnect_storm(config: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with soak.serve(config, log_dir=tmp_path) as srv:
            rep = await soak.mixed(
                srv, seconds=8.0, concurrency=8, max_out=24, prompt_words=(2, 8, 24), warmup_frac=0.5, out_dir=tmp_path
            )
            _assert_ok(rep)
            assert rep.figures["requests"] > 20 and set(rep.figures["by_kind"]) >= {"stream", "cancel", "n", "embed"}
            assert (tmp_path / "soak-mixed.png").read_bytes()[:4] == b"\x89PNG"
            _assert_ok(await soak.storm(srv, streams=100, max_out=120))

    asyncio.run(main())


def test_sigterm_under_64_streams_drains_and_exits_0(config: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with soak.serve(config, {"max_num_seqs": "16"}, log_dir=tmp_path) as srv:
            _assert_ok(await soak.sigterm(srv, streams=64, max_out=24))

    asyncio.run(main())


def test_kv_exhaustion_completes_every_request_with_uncontended_outputs(config: str, tmp_path: Path) -> None:
    async def main() -> None:
        # 24 requests x ~(60-200 prompt + 48 output) tokens / 4 per block ~ 1000+ blocks of demand.
        async with soak.serve(config, {"num_kv_blocks": "110"}, log_dir=tmp_path) as srv:
            _assert_ok(await soak.kv_exhaustion(srv, requests=24, max_out=48))

    asyncio.run(main())


def test_rss_growth_per_10_minutes_from_minute_5() -> None:
    """The memory criterion's figure from the per-minute medians: the 30-minute soak's
    (docs/soak-mixed-30min.png: 3900.5 MiB at minute 5, 3937.7 at minute 29) is +0.40% per 10
    min; a soak without a minute after minute 5 has none (its check is the warm-up one)."""
    per_minute = [3800.0] * 5 + [3900.5] + [3920.0] * 23 + [3937.7]
    growth = soak.rss_growth_per_10min(per_minute)
    assert growth is not None and round(growth, 2) == 0.40
    assert soak.rss_growth_per_10min([100.0, 101.0, 102.0, 103.0, 104.0, 105.0]) is None
    assert soak.rss_growth_per_10min([100.0] * 5 + [100.0, 101.0]) == pytest.approx(10.0)
