"""The served model as serve/ sees it: one frozen record that tl/entry/build.py hands over beside the
AsyncEngine, and the protocols its tokenizer and chat template are used through.

Owns: ServedModel (model id, context length, the vocabulary size from the model's config, the
largest top_logprobs, tokenizer, chat template, tool calling, reasoning) and the two protocols, each
naming every member serve/ calls (tl/text/tokenizer.py's Tokenizer and tl/text/chat_template.py's
ChatTemplate implement them, as do the fakes of tests/helpers/fake_engine.py). Pure data: must not
import jax, the runner or the engine. Tested through tests/serve/test_serve_app.py and
tests/test_layering.py (serve/ may import it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tl.text.reasoning import Markers
from tl.text.tools import ToolSetup


class TextTokenizer(Protocol):
    """Text <-> token ids, as serve/ uses them (tl.text.tokenizer.Tokenizer)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of text (no BOS/EOS added)."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt: BOS first where the model's tokenizer adds it (Gemma)."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token_id adds to the output (b"" for an id past the tokenizer's)."""
        ...

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that are counted but never shown in the output text."""
        ...

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's text, None when it is not one token."""
        ...


class ChatRenderer(Protocol):
    """A chat template (tl.text.chat_template.ChatTemplate): messages to the prompt text."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """kwargs: extra template variables (a request's chat_template_kwargs, enable_thinking)."""
        ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    """Everything serve/ knows of the model it serves; each value has one source."""

    model_id: str
    """The id requests name (EngineConfig.served_model_id)."""
    max_model_len: int
    """Context length, prompt plus output (the engine's)."""
    vocab_size: int
    """Token ids a request may carry are below this (the model's config)."""
    max_logprobs: int
    """The most top_logprobs a request may ask for (EngineConfig.max_logprobs)."""
    tokenizer: TextTokenizer
    chat_template: ChatRenderer
    tools: ToolSetup | None = None
    """How the model calls tools: the format its calls are parsed in and the template that
    renders a request with tools (None: requests with tools are refused)."""
    reasoning: Markers | None = None
    """The thinking markers when the model's answers are split into thinking and answer
    (tl/text/reasoning.py setup; None: never split)."""
    thinking_token_budget: int | None = None
    """Most tokens a request may think when it sets no budget itself
    (EngineConfig.thinking_token_budget; None: no limit)."""
