"""PNG plots for benchmark reports: throughput vs concurrency, latency CDFs.

Owns drawing only, from plain numbers (no tl, no HTTP); matplotlib with the Agg backend so it
runs headless. Install with the `bench` extra (`pip install -e .[bench]`). Tested by
tests/bench/test_bench_harness.py (files are written and are PNGs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(
    series: Mapping[str, Sequence[tuple[int, float]]],
    path: str | Path,
    title: str = "Aggregate output throughput vs concurrency",
) -> Path:
    """series: server name -> [(concurrency, output tokens/s)]."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in series.items():
        pts = sorted(pts)
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_cdfs(panels: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path, title: str = "") -> Path:
    """panels: panel title (e.g. 'TTFT ms') -> curve label -> samples. One empirical CDF per curve."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (name, curves) in zip(axes[0], panels.items(), strict=False):
        for label, xs in curves.items():
            if not xs:
                continue
            s = sorted(xs)
            ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=f"{label} (n={len(s)})")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction ≤ x")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
