"""A conversation as prompt text, through the chat template, as vLLM and transformers make it.

``add_generation_prompt`` (default true) ends the text with the template's opening of an
assistant turn; ``continue_final_message`` instead leaves the last message open, so the model
continues it (a "prefill" of its answer): the text is cut right after that message's content,
as transformers cuts it. The two cannot be asked together (vLLM's rule).
"""

from __future__ import annotations

from typing import Any

from pagekv.errors import InvalidRequestError
from pagekv.server.state import RenderChat


def chat_prompt(
    render: RenderChat,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of ``messages`` (InvalidRequestError naming the field at fault)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message: cannot be true with add_generation_prompt (set that false)",
            "continue_final_message",
        )
    text = render(messages, add_generation_prompt, tools)
    if not continue_final_message:
        return text
    final = str(messages[-1].get("content") or "")
    if not final.strip() or final.strip() not in text:
        raise InvalidRequestError(
            "continue_final_message: the final message's content does not appear in the "
            "templated prompt (an empty final message cannot be continued)",
            "continue_final_message",
        )
    where = text.rindex(final.strip())
    length = len(final.lstrip())
    if text[where : where + length] != final:  # the template trimmed the message's spaces
        length = len(final.strip())
    return text[: where + length]
