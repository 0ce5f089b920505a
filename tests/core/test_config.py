"""EngineConfig: defaults are valid, every bound names the key and the value."""

from __future__ import annotations

import pytest

from tl.core.config import ConfigError, EngineConfig, engine_keys


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
        ({"decode_steps": 0}, "decode_steps"),
        ({"decode_steps": 65}, "decode_steps"),
        ({"decode_steps_max_ms": 0}, "decode_steps_max_ms"),
    ],
)
def test_bad_values_name_the_key(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**changes)  # type: ignore[arg-type]


def test_readme_documents_every_engine_key() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [k for k in engine_keys() if f"| `{k}` |" not in readme]
    assert not missing, f"README lacks [engine] keys {missing}"


def test_every_literal_key_refuses_other_values_naming_its_choices() -> None:
    """The choices are read from each key's Literal type (one place), so a new choice or key is
    checked without another list to update."""
    import typing

    hints = typing.get_type_hints(EngineConfig)
    literal = {k: typing.get_args(t) for k, t in hints.items() if typing.get_origin(t) is typing.Literal}
    assert {"dtype", "backend", "attention_kernel", "native_target", "prefix_cache", "tool_parser"} <= set(literal)
    for key, choices in literal.items():
        for ok in choices:
            EngineConfig(**{key: ok})  # type: ignore[arg-type]  # every choice is accepted as far as this key goes
        with pytest.raises(ConfigError) as e:
            EngineConfig(**{key: "no-such-choice"})  # type: ignore[arg-type]
        assert str(e.value).startswith(f"{key} must be") and all(c in str(e.value) for c in choices)
