"""The prompt forms of the offline API, as vLLM's ``vllm.inputs`` names them (plain types; no
torch). ``LLM.generate`` and ``LLM.beam_search`` take a string, a list of token ids, or one of
these dicts (engine/prompts.py reads them); multi-modal data is refused by name.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt; ``cache_salt`` keeps its prefix-cache blocks apart from other salts'."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A tokenized prompt; ``prompt``, if given, is only reported back as
    ``RequestOutput.prompt``."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
