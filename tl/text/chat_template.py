"""ChatTemplate: render chat messages into a prompt exactly as transformers' apply_chat_template.

Owns: the jinja2 environment transformers uses for chat templates
(ImmutableSandboxedEnvironment with trim_blocks/lstrip_blocks, loopcontrols, the
`{% generation %}` block, its tojson, raise_exception, strftime_now, dict and a
namespace that refuses underscore names), message normalization (None-valued keys
dropped, reasoning aliased), choosing among named templates, and finding a model dir's template.
Must not tokenize (the rendered prompt is encoded by tl/text/tokenizer.py without adding
special tokens) and must not import jax. Tested by tests/text/test_chat_template.py
(SmolLM2's real template byte for byte, jinja features, errors).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tl.model.files import load_generation_config, load_tokenizer_config

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """A chat template does not parse, or raised while rendering; the message says why."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to
    mark assistant tokens; we only need templates that use it to parse and render)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it a plain set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace refusing underscore-prefixed attributes (no CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_Namespace
    )
    return env


def _compile(env: ImmutableSandboxedEnvironment, source: str, name: str) -> jinja2.Template:
    if not isinstance(source, str):
        raise TemplateError(f"chat template {name!r} must be a string, got {type(source).__name__}")
    try:
        _check_names(env, env.parse(source))
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template {name!r} line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:  # TemplateAssertionError (unknown filter/test) and the like
        raise TemplateError(f"chat template {name!r}: {e}") from None


def _check_names(env: ImmutableSandboxedEnvironment, ast: jinja2.nodes.Template) -> None:
    """Refuse unknown filters and tests anywhere. jinja defers those inside `{% if %}` to
    render time; a template whose branch would always fail is refused up front."""
    for node in ast.find_all((jinja2.nodes.Filter, jinja2.nodes.Test)):
        known = env.filters if isinstance(node, jinja2.nodes.Filter) else env.tests
        if node.name not in known:
            kind = "filter" if isinstance(node, jinja2.nodes.Filter) else "test"
            raise jinja2.TemplateSyntaxError(f"No {kind} named {node.name!r}.", node.lineno)


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning comes under, the one templates read (Qwen3's) first."""


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dicts with None-valued keys dropped, and a message's reasoning under every name in
    REASONING_FIELDS: transformers' apply_chat_template does both (its _alias_reasoning_fields), so
    `reasoning` from an API client reaches a template reading `reasoning_content` (Qwen3) or
    `thinking` (gpt-oss), with the keys in the same order as there."""
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise TemplateError(f"chat messages must be objects, got {type(m).__name__}")
        message = {k: v for k, v in m.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A compiled chat template (or named set of them) plus the special tokens it may use."""

    def __init__(
        self, source: str | Mapping[str, str], bos_token: str | None = None, eos_token: str | None = None
    ) -> None:
        env = _environment()
        named = {"default": source} if isinstance(source, str) else dict(source)
        if "default" not in named:
            raise TemplateError(f"named chat templates {sorted(named)} have no 'default'")
        self._templates = {name: _compile(env, src, name) for name, src in named.items()}
        self.sources = named
        """The template sources by name (tl/text/tools.py reads them to detect the tool-call format)."""
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """generation_config.json's template, else chat_template.jinja, else tokenizer_config.json's,
        else DEFAULT_TEMPLATE; bos/eos tokens from tokenizer_config.json."""
        d = Path(model_dir)
        tcfg = load_tokenizer_config(d)
        source: str | dict[str, str] | None = load_generation_config(d).chat_template
        if source is None and (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if source is None:
            source = tcfg.chat_template
        return cls(DEFAULT_TEMPLATE if source is None else source, tcfg.bos_token, tcfg.eos_token)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text. `tools` selects the 'tool_use' template when there is one.
        Errors raised by the template (raise_exception, type errors) become TemplateError."""
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context = {**{k: v for k, v in tokens.items() if v is not None}, **extra}  # unset tokens stay undefined
        try:
            return self._templates[name].render(
                messages=normalize_messages(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template raised: {e.message or e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
