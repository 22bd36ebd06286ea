"""Incremental detokenization and stop strings, per generated sequence; each token's own text
for logprobs (``TokenTexts``). No torch.

Decoding one token at a time is wrong for byte-level BPE: a character may span several tokens,
and a lone token decodes to U+FFFD. So the detokenizer decodes a short window (from
``prefix_offset``) and emits only what that window adds beyond its already-read part, holding
text back while it ends in an incomplete character. A logprob's ``decoded_token`` is the token
alone, as vLLM spells it; one that ends in U+FFFD (the middle of a character) is completed from
the tokens before it where they complete the character (else "").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Owns one sequence's output text; ``append`` returns the new text (maybe "")."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def append(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        ids, decode = self.token_ids, self._tokenizer.decode
        read = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = decode(ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if full.endswith("\ufffd") or len(full) <= len(read):
            return ""
        delta = full[len(read) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self.text += delta
        return delta

    def find_stop(self, stops: Sequence[str], num_new_chars: int) -> tuple[str, int] | None:
        """The first stop string that the last ``num_new_chars`` characters completed, and where
        it starts in ``text``."""
        best: tuple[str, int] | None = None
        for stop in stops:
            start = max(0, len(self.text) - num_new_chars - len(stop) + 1)
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[1]):
                best = (stop, at)
        return best

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]


# vLLM looks back this many tokens to complete a character (UTF-8 has at most 4 bytes).
MAX_CONTEXT_TOKENS = 4


class TokenTexts:
    """Token id -> its text alone, special tokens spelled out (``Logprob.decoded_token``).

    Owns a memo of each token's own text (the tokenizer is immutable, so one instance serves
    every request of an engine; it grows to the vocabulary's size at most)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def alone(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def __call__(self, token_id: int, context: Sequence[int]) -> str:
        """The text of ``token_id`` after ``context`` (the tokens before it in the sequence):
        its own, or, where that ends inside a character, what it adds to the context's."""
        text = self.alone(token_id)
        if not text.endswith("\ufffd"):
            return text
        return self._completed(token_id, list(context[-MAX_CONTEXT_TOKENS:]))

    def _completed(self, token_id: int, context: list[int]) -> str:
        """vLLM's correction: with the fewest context tokens that complete the character, the
        text beyond the context's own complete part ("" when none completes it)."""
        decode = self._tokenizer.decode
        for num in range(1, len(context) + 1):
            window = context[-num:]
            full = decode([*window, token_id], skip_special_tokens=False)
            if full.endswith("\ufffd"):
                continue
            clean = len(window)  # context tokens before the unfinished character's bytes
            while clean > 0 and self.alone(window[clean - 1]).endswith("\ufffd"):
                clean -= 1
            prefix = decode(window[:clean], skip_special_tokens=False) if clean else ""
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""
