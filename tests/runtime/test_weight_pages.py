"""weight_pages "huge": the CPU weights in one mapping advised for huge pages (tl/runtime/weight_pages.py).

Placement keeps every value and dtype, aliases the mapping (each leaf inside one region,
cache-line aligned, no copy), advises it (the kernel's own THPeligible flag for the region),
copies what DLPack cannot carry (bfloat16; an all-bfloat16 model keeps XLA's buffers and says
so), and unmaps the region when the last array goes; a runner on huge pages generates what a
runner on XLA's buffers does and says which it runs.
"""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from tests.helpers.runner import ENGINE, Seq, generate, make_runner
from tl.core.config import ConfigError, EngineConfig
from tl.runtime import weight_pages

needs_thp = pytest.mark.skipif(bool(weight_pages.unavailable_reason()), reason=weight_pages.unavailable_reason())


def _region(addr: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry (its header and fields) of the mapping holding addr, if any."""
    entry: dict[str, str] | None = None
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            if found is not None:
                return found
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = {"range": head}
            found = entry if lo <= addr < hi else None
        elif entry is not None and ":" in head:
            entry[head.rstrip(":")] = line.split(None, 1)[1].strip() if len(line.split()) > 1 else ""
    return found


def _one_device(tree: object) -> object:
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]), tree)


def _tree() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((300, 70)).astype(np.float32),
        "q": {"q": rng.integers(-127, 128, (33, 7), dtype=np.int8), "scale": rng.random(33).astype(np.float32)},
        "bits": rng.integers(0, 1 << 16, (5, 3, 17), dtype=np.uint16),
        "odd": rng.standard_normal(3).astype(np.float32),
        "bf16": rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16),
    }


@needs_thp
def test_place_aliases_one_advised_mapping() -> None:
    tree = _tree()
    placed, nbytes = weight_pages.place(tree, _one_device(tree))
    assert nbytes % weight_pages.HUGE_PAGE == 0
    flat, _ = jax.tree.flatten(tree)
    out, _ = jax.tree.flatten(placed)
    regions, ptrs = set(), []
    for want, got in zip(flat, out, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
        if want.dtype == ml_dtypes.bfloat16:
            continue  # copied into XLA's buffers
        ptr = got.unsafe_buffer_pointer()
        ptrs.append(ptr)
        assert ptr % weight_pages.ALIGN == 0
        region = _region(ptr)
        assert region is not None
        regions.add(region["range"])
        assert region.get("THPeligible") == "1", region  # madvise(MADV_HUGEPAGE) took
    assert len(regions) == 1
    assert min(ptrs) % weight_pages.HUGE_PAGE == 0  # the arena starts on a huge page


@needs_thp
def test_mapping_goes_with_the_last_array() -> None:
    tree = {"a": np.ones((1024, 512), np.float32), "b": np.zeros(10, np.int8)}
    placed, _ = weight_pages.place(tree, _one_device(tree))
    ptr = placed["a"].unsafe_buffer_pointer()
    b = placed["b"]
    del placed
    gc.collect()
    assert _region(ptr) is not None  # b still holds the mapping
    np.testing.assert_array_equal(np.asarray(b), 0)
    del b
    gc.collect()
    assert _region(ptr) is None


@needs_thp
def test_runner_on_huge_pages_matches_default_pages() -> None:
    prompts = [[5, 9, 2, 77, 31, 8, 150, 4, 19, 60, 3], [7, 7, 1] * 5, list(range(100, 120))]

    def run(pages: str) -> tuple[object, list[Seq]]:
        runner, _ = make_runner(ENGINE.replace(weight_pages=pages))
        return runner, generate(runner, prompts, 8, chunk=8)

    huge, got = run("huge")
    default, want = run("default")
    assert huge.plan.weight_pages.value == "huge" and "MADV_HUGEPAGE" in huge.plan.weight_pages.reason
    assert default.plan.weight_pages.value == "default" and default.plan.weight_pages.reason == "configured"
    leaf = jax.tree.leaves(huge._params)[0]
    assert _region(leaf.unsafe_buffer_pointer()).get("THPeligible") == "1"  # type: ignore[union-attr]
    assert leaf.sharding == jax.tree.leaves(default._params)[0].sharding
    for a, b in zip(got, want, strict=True):
        assert a.out == b.out and a.logprobs == b.logprobs


def test_thp_never_falls_back_with_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(weight_pages, "THP_ENABLED", never)
    assert "never" in weight_pages.unavailable_reason()
    runner, _ = make_runner(ENGINE.replace(weight_pages="huge"))
    assert runner.plan.weight_pages.value == "default" and "never" in runner.plan.weight_pages.reason


def test_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match="weight_pages"):
        EngineConfig(weight_pages="large")  # type: ignore[arg-type]


@needs_thp
def test_bfloat16_weights_keep_xla_buffers_and_say_why() -> None:
    runner, _ = make_runner(ENGINE.replace(dtype="bfloat16"))
    assert runner.plan.weight_pages.value == "default" and "bfloat16" in runner.plan.weight_pages.reason
