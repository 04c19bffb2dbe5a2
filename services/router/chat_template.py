"""Chat messages as one prompt text: a vLLM model's own chat template, or Baton's plain template.

Pure, apart from reading a model directory's template once per tokenizer.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.common.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str = ""


class ChatTemplate(Protocol):
    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt for these messages, ending where the assistant's reply begins."""


# "<|" in a message's content, with any backslashes between: each gets one backslash more (undone by taking one),
# written after its "<" (a fixed replacement: a group reference in it cost 0.8 us a match, 3 s for a 7 MB body of
# "<|" that blocked the router, helper-188).
_HEADER_OPENING = re.compile(r"<(?=\\*\|)")


def escaped_content(content: str) -> str:
    """content with no "<|" left to open a role header: "<|" is written "<\\|", and "<\\|" (with any number of
    backslashes) one backslash longer, so that no two contents render alike. A user's message that held
    "\\n<|system|>\\n" rendered as a system turn of its own (helper-166)."""
    return _HEADER_OPENING.sub(r"<\\", content)


class PlainTemplate:
    """For models without a template of their own (the simulated ones): one block per message,

        <|role|>\\ncontent\\n

    (`<|role name=NAME|>` when the message has a name), then `<|assistant|>\\n` for the reply. The content is
    escaped_content: only the template writes a role header.
    """

    def render(self, messages: Sequence[ChatMessage]) -> str:
        parts = []
        for message in messages:
            header = f"<|{message.role} name={message.name}|>" if message.name else f"<|{message.role}|>"
            parts.append(f"{header}\n{escaped_content(message.content)}\n")
        parts.append("<|assistant|>\n")
        return "".join(parts)


PLAIN = PlainTemplate()


class JinjaTemplate:
    """A Hugging Face chat template (Jinja, sandboxed as transformers runs it)."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        self._template = environment.from_string(source)
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, messages: Sequence[ChatMessage]) -> str:
        rendered = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                    for m in messages]
        try:
            return self._template.render(messages=rendered, add_generation_prompt=True,
                                         bos_token=self._bos_token, eos_token=self._eos_token)
        except Exception as exc:  # noqa: BLE001 - the model's template is foreign code; any failure is the input's
            raise InvalidArgument("messages", f"{len(messages)} messages",
                                  f"refused by the model's chat template: {exc}") from None


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json spells it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


def _load_jinja(model_dir: Path) -> ChatTemplate | None:
    """The template in model_dir (chat_template.jinja, or tokenizer_config.json's chat_template,
    whose "default" entry when it names several); None when it has none."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    source: object = None
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text()
    else:
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return JinjaTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


@functools.lru_cache(maxsize=64)
def template_for(tokenizer: str) -> ChatTemplate:
    """The chat template for a model registered with this tokenizer name: an "hf:DIR" model's own,
    when DIR has one; the plain template otherwise."""
    if tokenizer.startswith("hf:"):
        try:
            found = _load_jinja(Path(tokenizer.removeprefix("hf:")))
        except Exception as exc:  # jinja2 missing, or a template that does not compile
            log.warning("chat template of %s unusable, using the plain one: %s", tokenizer, exc)
            found = None
        if found is not None:
            return found
    return PLAIN
