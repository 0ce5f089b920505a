"""runtime.toml and TL_ENGINE__ overrides (runtime_toml_and_env_overrides)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve.config_load import load_config, parse_runtime_toml
from serve.launch import granian_argv
from serve.process import parse_listen
from tl.core.config import ConfigError, EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_runtime_toml_is_the_defaults() -> None:
    assert load_config(str(ROOT / "configs" / "runtime.toml"), {}) == EngineConfig()


def test_keys_and_env_overrides_by_type() -> None:
    text = '[engine]\nmodel_dir = "m/succ"\nprefill_chunk = 64\nhttp_listen = ":8000"\ndrain_timeout_s = 5\n'
    env = {
        "TL_ENGINE__MODEL_DIR": "other/dir",
        "TL_ENGINE__PREFILL_CHUNK": "32",
        "TL_ENGINE__TOKEN_BUCKETS": "16,32,512",
        "TL_ENGINE__API_KEYS": "k1, k2",
        "TL_ENGINE__QUEUE_DEADLINE_MS": "250",
        "TL_ENGINE__DRAIN_TIMEOUT_S": "1.5",
        "TL_ENGINE__NATIVE_CXX": "clang++",
        "TL_ENGINE__NATIVE_CACHE_DIR": "/var/cache/tl",
        "CXX": "/bin/false",  # not an override: the library reads no CXX
        "PATH": "/bin",
    }
    cfg = parse_runtime_toml(text, env)
    assert (cfg.model_dir, cfg.prefill_chunk, cfg.token_buckets, cfg.api_keys) == (
        "other/dir",
        32,
        (16, 32, 512),
        ("k1", "k2"),
    )
    assert (cfg.queue_deadline_ms, cfg.drain_timeout_s, cfg.http_listen) == (250, 1.5, ":8000")
    assert (cfg.native_cxx, cfg.native_cache_dir) == ("clang++", "/var/cache/tl")
    assert cfg.served_model_id() == "dir"
    assert parse_runtime_toml(text, {}).drain_timeout_s == 5.0
    assert parse_listen(":8000") == ("0.0.0.0", 8000) and parse_listen("127.0.0.1:9") == ("127.0.0.1", 9)


@pytest.mark.parametrize(
    "text,env,names",
    [
        ("[engine]\nmodel_dirr = 'x'\n", {}, ["model_dirr"]),
        ("[engine]\n[server]\nport = 1\n", {}, ["server"]),
        ("[engine]\nprefill_chunk = 'big'\n", {}, ["prefill_chunk", "'big'"]),
        ("[engine]\nprefix_cache = 'lru'\n", {}, ["prefix_cache", "lru"]),
        ("[engine]\ntoken_buckets = [16, 'x']\n", {}, ["token_buckets"]),
        ("[engine]\nqueue_capacity = 0\n", {}, ["queue_capacity", "0"]),
        ("[engine]\n", {"TL_ENGINE__NOPE": "1"}, ["TL_ENGINE__NOPE"]),
        ("[engine]\n", {"TL_ENGINE__PREFILL_CHUNK": "lots"}, ["TL_ENGINE__PREFILL_CHUNK", "lots"]),
        ("[engine]\n", {"TL_ENGINE__BLOCK_SIZE": "3"}, ["block_size", "3"]),
        ("[engine]\n", {"TL_ENGINE__OVERLAP": "true"}, ["overlap", "true"]),
        ("[engine\n", {}, ["runtime.toml"]),
    ],
)
def test_unknown_keys_and_bad_values_are_refused_by_name(text: str, env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        parse_runtime_toml(text, env)
    assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize(
    "key,text,want",
    [
        ("API_KEYS", '["k1","k2"]', ("k1", "k2")),
        ("API_KEYS", ' [ "k1" , "k,2" ] ', ("k1", "k,2")),  # a JSON string may hold a comma
        ("API_KEYS", "[]", ()),
        ("API_KEYS", "k1,k2", ("k1", "k2")),
        ("API_KEYS", "", ()),
        ("TOKEN_BUCKETS", "[16, 32, 512]", (16, 32, 512)),
        ("TOKEN_BUCKETS", "16,32,512", (16, 32, 512)),
    ],
)
def test_list_overrides_are_a_json_array_or_comma_separated(key: str, text: str, want: tuple[object, ...]) -> None:
    cfg = parse_runtime_toml("[engine]\n", {f"TL_ENGINE__{key}": text})
    assert getattr(cfg, key.lower()) == want


@pytest.mark.parametrize(
    "key,text",
    [
        ("API_KEYS", "[1,"),
        ("API_KEYS", '["a", 2]'),
        ("API_KEYS", '["a"'),
        ("TOKEN_BUCKETS", '["x"]'),
        ("TOKEN_BUCKETS", "[16, true]"),
        ("SEQ_BUCKETS", "[1.5]"),
        ("SEQ_BUCKETS", "[[1]]"),
    ],
)
def test_a_value_opening_a_json_array_must_be_one_of_the_key_type(key: str, text: str) -> None:
    with pytest.raises(ConfigError, match=f"TL_ENGINE__{key}=") as e:
        parse_runtime_toml("[engine]\n", {f"TL_ENGINE__{key}": text})
    assert "JSON array" in str(e.value), str(e.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(str(tmp_path / "nope.toml"), {})


def test_launch_argv_uses_http_listen(tmp_path: Path) -> None:
    p = tmp_path / "rt.toml"
    p.write_text('[engine]\nhttp_listen = "127.0.0.1:8123"\ndrain_timeout_s = 7.5\n')
    argv = granian_argv(str(p))
    assert argv[1:] == [
        "--interface",
        "asgi",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--workers",
        "1",
        "--http",
        "1",
        "--no-ws",
        "--workers-kill-timeout",
        "21",  # drain_timeout_s + STOP_BOUND_S (7.5 + 13), rounded up: a wedged worker is killed then
        "serve.app:app",
    ]
    assert (
        granian_argv(str(p), "tests.helpers.fake_app:app")[-1] == "tests.helpers.fake_app:app"
    )  # the tests' own target


def test_the_stop_bound_is_its_parts_plus_a_margin() -> None:
    """STOP_BOUND_S covers every bounded step after the drain deadline (README, "Stopping") and
    leaves a margin for what has no bound of ours (granian's server stop, the process exit)."""
    from serve import process

    after_deadline = (
        process.ABORT_GRACE_S,
        process.ENGINE_STOP_WAIT_S,  # the engine thread's own ENGINE_STOP_S and the wait's extra second
        max(process.HEALTH_CLOSE_S, process.TRACING_STOP_S),  # the spans' export runs beside the close
    )
    assert process.ENGINE_STOP_WAIT_S > process.ENGINE_STOP_S
    assert process.STOP_MARGIN_S >= 2.0
    assert process.STOP_BOUND_S == sum(after_deadline) + process.STOP_MARGIN_S == 13.0
