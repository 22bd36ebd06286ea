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
from jinja2 import meta, nodes
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


def read_chat_template(value: str) -> str:
    """vLLM's ``chat_template`` argument: a file's path (its text is read) or the template's
    own text (anything holding a brace or a newline)."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the text
        if any(c in value for c in "{}\n"):
            return value
        raise InvalidRequestError(
            f"chat_template: {value!r} looks like a path but cannot be read ({exc})",
            "chat_template",
        ) from None


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
            # the names the template reads: chat_template_kwargs it does not read are dropped
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
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
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a validated conversation; template errors become
        InvalidRequestError (templates raise them for e.g. roles that do not alternate).

        ``tools`` (OpenAI's tool definitions) go to a template that reads them; for one that
        does not, they are described in a system message (``tools_system_text``).
        ``continue_final_message``: the text ends with the last message's content, left open
        for the model to continue (as transformers does; not with ``add_generation_prompt``).
        ``template_kwargs``: more variables for the template (vLLM's chat_template_kwargs,
        e.g. ``enable_thinking``); those the template does not read are dropped, as vLLM does."""
        checked = validate_messages(messages)
        extra = self._template_kwargs(template_kwargs)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message continues the last message; it cannot be combined "
                "with add_generation_prompt, which starts a new one",
                "continue_final_message",
            )
        if tools and self.takes_tools:
            extra["tools"] = tools
        elif tools:
            checked = with_tools_message(checked, tools)
        try:
            text = self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from exc
        return _open_final_message(text, checked[-1]["content"]) if continue_final_message else text

    def _template_kwargs(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        reserved = {"messages", "add_generation_prompt", "tools", "chat_template", "tokenize"}
        for name in given or {}:
            if not isinstance(name, str) or name in reserved:
                raise InvalidRequestError(
                    f"chat_template_kwargs: {name!r} is set by the call itself, not here",
                    "chat_template_kwargs",
                )
        return {k: v for k, v in (given or {}).items() if k in self.variables}


def _open_final_message(text: str, final: str) -> str:
    """``text`` cut right after the final message's content, so the model continues it.
    Templates that strip the content are matched by the stripped content."""
    stripped = final.strip()
    where = text.rfind(stripped) if stripped else -1
    if where < 0:
        raise InvalidRequestError(
            "continue_final_message: the chat template does not write the final message's "
            "content as given, so there is no end to continue from",
            "continue_final_message",
        )
    kept = final.lstrip()
    if text[where : where + len(kept)] == kept:  # the template keeps trailing spaces
        return text[: where + len(kept)]
    return text[: where + len(stripped)]


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
