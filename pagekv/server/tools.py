"""Tool calls for chat: what ``tools`` and ``tool_choice`` ask of a request, and the parsing of
the model's answer into OpenAI ``tool_calls``.

``ToolPlan.of`` reads the request: ``none`` (tools ignored), ``auto`` (the model may answer
with text or with calls in the tagged form the prompt describes, ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``), ``required`` (the output is constrained to a JSON array of
one or more calls of the given tools) or a named function (the output is constrained to that
function's arguments; so ``strict`` tools are refused under ``auto``, which cannot hold a call
to its schema). ``split`` turns the text into content and calls. The tags come from
the tokenizer (``Tokenizer.tool_call_tags``), which describes the tools to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import StructuredOutputsParams

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def _refuse_strict(definitions: tuple[dict[str, Any], ...]) -> None:
    """``strict`` arguments cannot be kept under ``auto``: its calls are parsed from free text."""
    for i, d in enumerate(definitions):
        if d["function"].get("strict"):
            field = f"tools[{i}].function.strict"
            raise InvalidRequestError(
                f"{field}: with tool_choice auto calls are parsed from free text, not held to "
                "their schema; use tool_choice required or a named function for strict calls",
                field,
            )


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: tuple[dict[str, Any], ...]  # the definitions, as chat templates take them
    named: str | None = None  # the function tool_choice names
    parallel: bool = True
    tags: tuple[str, str] = ("", "")  # what opens and closes a tagged call

    @classmethod
    def of(
        cls, tools: list[Any] | None, choice: Any, parallel: bool, tags: tuple[str, str]
    ) -> ToolPlan:
        """The plan for validated ``tools`` (pydantic models) and ``tool_choice``."""
        definitions = tuple(t.model_dump(exclude_none=True) for t in tools or ())
        names = [d["function"]["name"] for d in definitions]
        if choice is None:
            choice = "auto" if definitions else "none"
        if isinstance(choice, str):
            if choice != "none" and not definitions:
                raise InvalidRequestError(f"tool_choice: {choice!r} needs tools", "tool_choice")
            if choice == "auto":
                _refuse_strict(definitions)
            kept = definitions if choice != "none" else ()
            return cls(choice, kept, None, parallel, tags)  # type: ignore[arg-type]
        name = choice.function.name
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice: no tool named {name!r}; tools: {names}", "tool_choice"
            )
        return cls("named", definitions, name, parallel, tags)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def parameters(self, name: str) -> dict[str, Any]:
        for d in self.tools:
            if d["function"]["name"] == name:
                schema: dict[str, Any] = d["function"].get("parameters") or {"type": "object"}
                return schema
        raise KeyError(name)

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must match: the named function's arguments, or for ``required``
        an array of calls of the tools; None for ``auto`` and ``none``."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputsParams(json=self.parameters(self.named))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": d["function"]["name"]},
                    "arguments": self.parameters(d["function"]["name"]),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for d in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer; a text that holds no call is all content."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut off by max_tokens: no call to report
                return text, []
            return None, [
                ToolCall(i["name"], json.dumps(i["arguments"], ensure_ascii=False)) for i in items
            ]
        if self.mode == "none":
            return text, []
        return self._tagged(text)

    def _tagged(self, text: str) -> tuple[str | None, list[ToolCall]]:
        names = {d["function"]["name"] for d in self.tools}
        opening, closing = self.tags
        calls = []
        for match in re.finditer(re.escape(opening) + "(.*?)" + re.escape(closing), text, re.S):
            try:
                item = json.loads(match.group(1))
            except ValueError:
                continue
            if isinstance(item, dict) and item.get("name") in names:
                arguments = item.get("arguments", {})
                calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return text, []
        content = text[: text.index(opening)].strip()
        return content or None, calls

    def streamable(self, text: str, finished: bool) -> str:
        """How much of ``text`` may go out as content now: none under a constraint; in
        ``auto``, what comes before a call, holding back a tail that may open one."""
        if self.mode in ("named", "required"):
            return ""
        if self.mode == "none":
            return text
        opening = self.tags[0]
        start = text.find(opening)
        if start >= 0:
            return text[:start]
        if finished:
            return text
        for keep in range(min(len(opening) - 1, len(text)), 0, -1):
            if opening.startswith(text[-keep:]):
                return text[:-keep]
        return text
