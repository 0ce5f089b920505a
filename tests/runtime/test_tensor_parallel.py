"""Tensor parallelism on 8 fake CPU devices: runs tests/runtime/tp_cases.py in a subprocess.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax is imported, and the
rest of the suite assumes one device, so the cases run in their own pytest process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(select: str) -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runtime/tp_cases.py", "-k", select],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("select", ["eight_devices", "tiny_engine", "tiny_int8", "tiny_blocks", "tiny_family", "http"])
def test_tiny_engine_and_http(select: str) -> None:
    """One process per group of cases, so that `make test`'s workers share them out."""
    _run(select)


@pytest.mark.slow
def test_smollm2() -> None:
    _run("smol")
