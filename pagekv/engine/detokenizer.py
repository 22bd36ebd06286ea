"""Incremental detokenization and stop strings, per generated sequence. No torch.

Decoding one token at a time is wrong for byte-level BPE: a character may span several tokens,
and a lone token decodes to U+FFFD. So the detokenizer decodes a short window (from
``prefix_offset``) and emits only what that window adds beyond its already-read part, holding
text back while it ends in an incomplete character.
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
