"""The n-gram index a request keeps for drafting: where each n-gram of its tokens last ended.

Owns the positions of one sequence's n-grams; the request holds it (derived from its tokens,
like its block hashes) and ``speculation.py`` builds and reads it. It depends on nothing, so
the request and the drafting rules both import it without importing each other. Must not
import torch.
"""

from __future__ import annotations

from collections.abc import Sequence

NgramKey = tuple[int, ...]


class NgramIndex:
    """Where each n-gram of a token sequence last ended, kept up to date as tokens append.

    ``ends[gram] = e``: ``tokens[e - len(gram) : e] == gram`` and ``e`` is the latest such end
    with a token after it (``e < len(tokens)``). The sequence's own suffix is therefore never
    its own match. Extending by one token costs ``max_n`` dictionary writes.
    """

    __slots__ = ("_next_end", "ends", "max_n")

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.ends: dict[NgramKey, int] = {}
        self._next_end = 1  # the first end position not yet registered

    def extend(self, tokens: Sequence[int]) -> None:
        """Register the n-grams that end before each token added since the last call."""
        ends, max_n = self.ends, self.max_n
        for end in range(self._next_end, len(tokens)):
            for n in range(1, min(max_n, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        self._next_end = max(self._next_end, len(tokens))

    def draft(self, tokens: Sequence[int], min_n: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest suffix (``max_n`` .. ``min_n``
        tokens) seen before, copied on from its latest occurrence; [] if none was seen."""
        self.extend(tokens)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), min_n - 1, -1):
            end = self.ends.get(tuple(tokens[size - n :]))
            if end is None:
                continue
            draft: list[int] = []
            for i in range(end, end + limit):  # past the last token: copy what was drafted
                draft.append(tokens[i] if i < size else draft[i - size])
            return draft
        return []
