"""Rendering a conversation with the model's Jinja chat template, the way transformers does.

Owns the validation of chat messages (bad ones raise InvalidRequestError naming the problem) and
a sandboxed Jinja environment configured like transformers' (trim_blocks, lstrip_blocks, the
loopcontrols extension, a `{% generation %}` tag, `tojson`, `raise_exception`, `strftime_now`),
so a template renders to the same text here as there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagekv.errors import InvalidRequestError, ModelLoadError

ROLES = ("system", "user", "assistant", "tool")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference it just renders its body."""

    tags = {"generation"}  # noqa: RUF012  # jinja2's Extension API declares it as a class attr

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not, and templates rely on it.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def validate_messages(messages: object) -> list[dict[str, str]]:
    """Check the shape of a conversation; raise InvalidRequestError naming the first problem."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {ROLES}, got {role!r}", param=f"{where}.role"
            )
        if not isinstance(message.get("content"), str):
            raise InvalidRequestError(f"{where}.content must be a string", param=f"{where}.content")
    return messages


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelLoadError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._special_tokens = dict(special_tokens)

    @property
    def takes_tools(self) -> bool:
        """Whether the template itself lays out tool definitions (it reads ``tools``)."""
        return "tools" in self.source

    def render(
        self,
        messages: object,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a validated conversation; template errors become
        InvalidRequestError (templates raise them for e.g. roles that do not alternate).

        ``tools`` (OpenAI's tool definitions) go to a template that reads them; for one that
        does not, they are described in a system message (``tools_system_text``)."""
        checked = validate_messages(messages)
        extra: dict[str, Any] = {}
        if tools and self.takes_tools:
            extra["tools"] = tools
        elif tools:
            checked = with_tools_message(checked, tools)
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from exc


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """How a model whose template knows no tools is told of them: the definitions as JSON
    lines, and the tagged form of a call (the one Hermes-style templates teach)."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call these functions (one JSON definition per line):\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, answer with its name and arguments as JSON inside tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": "<function name>", "arguments": {{...}}}}\n'
        f"{TOOL_CALL_CLOSE}"
    )


def with_tools_message(
    messages: list[dict[str, str]], tools: list[dict[str, Any]]
) -> list[dict[str, str]]:
    """``messages`` with the tool description added to (or as) the leading system message."""
    text = tools_system_text(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
