"""EngineConfig: defaults are valid, every bound names the key and the value."""

from __future__ import annotations

import pytest

from tl.config import ConfigError, EngineConfig, engine_keys


def test_defaults_are_valid_and_complete() -> None:
    cfg = EngineConfig()
    assert cfg.served_model_id() == "smol-135m"
    assert cfg.spec_tokens == 0
    assert cfg.replace(speculative="prompt_lookup").spec_tokens == cfg.num_speculative_tokens
    assert "model_dir" in engine_keys() and "http_listen" in engine_keys()


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"block_size": 12}, "block_size"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
        ({"token_buckets": (64, 32)}, "token_buckets"),
        ({"token_buckets": (16, 32)}, "max_num_batched_tokens"),
        ({"seq_buckets": (1, 4)}, "max_num_seqs"),
        ({"prefix_cache": "lru"}, "prefix_cache"),
        ({"speculative": "medusa"}, "speculative"),
        ({"max_num_seqs": 1024, "seq_buckets": (1, 1024)}, "max_num_batched_tokens"),
        ({"queue_capacity": 0}, "queue_capacity"),
        ({"max_logprobs": 21}, "max_logprobs"),
        ({"group_start_timeout_s": 0}, "group_start_timeout_s"),
    ],
)
def test_bad_values_name_the_key(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**changes)  # type: ignore[arg-type]


def test_readme_documents_every_engine_key() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [k for k in engine_keys() if f"| `{k}` |" not in readme]
    assert not missing, f"README lacks [engine] keys {missing}"
