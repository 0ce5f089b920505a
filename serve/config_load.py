"""runtime.toml + `TL_ENGINE__<KEY>` environment overrides -> EngineConfig.

Owns: reading the config file named by TL_CONFIG, the `[engine]` table, and parsing
override strings by each field's declared type (a list: a JSON array, as pydantic-settings
and k8s manifests write it, or comma-separated text). Refuses unknown tables, unknown keys
and ill-typed values with a ConfigError naming them; range checks stay in EngineConfig.
Tested by tests/serve/test_serve_config.py.
"""

from __future__ import annotations

import json
import os
import tomllib
import typing
from collections.abc import Mapping
from typing import get_args, get_origin

from tl.core.config import ConfigError, EngineConfig, engine_keys

ENV_PREFIX = "TL_ENGINE__"
DEFAULT_CONFIG_PATH = "configs/runtime.toml"


def _field_types() -> dict[str, object]:
    hints = typing.get_type_hints(EngineConfig)
    return {name: hints[name] for name in engine_keys()}


def _coerce(key: str, value: object, typ: object) -> object:
    """Check a TOML value against the field type (lists become tuples)."""
    origin = get_origin(typ)
    if origin is typing.Literal:
        if value not in get_args(typ):
            raise ConfigError(f"[engine].{key} must be one of {list(get_args(typ))}, got {value!r}")
        return value
    if origin is tuple:
        (elem,) = {a for a in get_args(typ) if a is not Ellipsis}
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"[engine].{key} must be a list of {elem.__name__}, got {value!r}")
        return tuple(_coerce(key, v, elem) for v in value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):  # type: ignore[arg-type]  # typ: a field's plain class here
        raise ConfigError(f"[engine].{key} must be {getattr(typ, '__name__', typ)}, got {value!r}")
    return value


def _is_a(value: object, typ: type) -> bool:
    """A JSON value of `typ` (ints for floats, never bools for numbers)."""
    if isinstance(value, bool):
        return typ is bool
    return isinstance(value, typ) or (typ is float and isinstance(value, int))


def _parse_json_array(key: str, text: str, elem: type) -> tuple[object, ...]:
    """A list override written as a JSON array: every element of the field's element type."""
    name = f"{ENV_PREFIX}{key.upper()}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name}={text!r}: not a valid JSON array ({e.msg})") from None
    if not isinstance(value, list) or not all(_is_a(v, elem) for v in value):
        raise ConfigError(f"{name}={text!r}: not a JSON array of {elem.__name__}")
    return tuple(value)


def _parse_env(key: str, text: str, typ: object) -> object:
    """Parse one override string by the field's type. Tuples: a JSON array ('["k1", "k2"]', what
    starts with "[") or comma-separated text ("16,32"; "" is an empty tuple)."""
    origin = get_origin(typ)
    if origin is tuple and text.lstrip().startswith("["):
        (elem,) = {a for a in get_args(typ) if a is not Ellipsis}
        return _parse_json_array(key, text, elem)
    try:
        if origin is tuple:
            (elem,) = {a for a in get_args(typ) if a is not Ellipsis}
            parts = [p.strip() for p in text.split(",") if p.strip()]
            return tuple(_parse_env(key, p, elem) for p in parts)
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{key.upper()}={text!r}: not a valid {getattr(typ, '__name__', typ)}") from None
    return text


def engine_config_from(table: Mapping[str, object], env: Mapping[str, str]) -> EngineConfig:
    """Build the config from an `[engine]` table and an environment mapping."""
    types = _field_types()
    unknown = sorted(k for k in table if k not in types)
    if unknown:
        raise ConfigError(f"unknown [engine] keys: {', '.join(unknown)}")
    kwargs = {k: _coerce(k, v, types[k]) for k, v in table.items()}
    bad_env = []
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in types:
            bad_env.append(name)
            continue
        kwargs[key] = _coerce(key, _parse_env(key, text, types[key]), types[key])
    if bad_env:
        raise ConfigError(f"unknown engine override variables: {', '.join(sorted(bad_env))}")
    return EngineConfig(**kwargs)  # type: ignore[arg-type]  # each value coerced to its field's type above


def parse_runtime_toml(text: str, env: Mapping[str, str]) -> EngineConfig:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"runtime.toml: {e}") from None
    extra = sorted(k for k in doc if k != "engine")
    if extra:
        raise ConfigError(f"unknown runtime.toml tables or keys: {', '.join(extra)}")
    table = doc.get("engine", {})
    if not isinstance(table, dict):
        raise ConfigError("runtime.toml: [engine] must be a table")
    return engine_config_from(table, env)


def load_config(path: str | None = None, env: Mapping[str, str] | None = None) -> EngineConfig:
    """Load TL_CONFIG (or `path`, or configs/runtime.toml) with the environment's overrides."""
    env = os.environ if env is None else env
    path = path or env.get("TL_CONFIG") or DEFAULT_CONFIG_PATH
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    return parse_runtime_toml(text, env)
