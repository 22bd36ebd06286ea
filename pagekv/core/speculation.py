"""Speculative decoding by n-gram lookup: draft tokens from the sequence's own history.

Owns the rule of what to draft and what to accept; the scheduler asks for drafts when it
schedules a decode, the runner computes the model's greedy token at every drafted position, and
``accept`` keeps the drafts up to the first that the model disagrees with. Greedy requests only:
what is accepted is exactly what decoding one token at a time would have produced, so a draft
costs compute, never correctness. Must not import torch.

How a draft is found (prompt lookup, as vLLM's ``ngram`` method): the last ``n`` tokens (n from
``max_n`` down to ``min_n``) are looked up among earlier positions of prompt + output; the
tokens that followed their latest occurrence are the draft. A repeating phrase, code that quotes
its input, a list that continues a pattern are drafted many tokens at a time::

    tokens   ... 7 3 9 5 | 7 3 9 5 | 7 3          suffix "7 3" last seen 4 back
    draft    9 5 7 3                              what followed it, copied on (it may overlap
                                                  the tokens it is producing, like LZ77)

One step of a drafted request feeds its last token and the k drafts, at k + 1 positions; the
model's greedy choice at position i either confirms draft i (go on) or replaces it (stop). So a
step yields 1 to k + 1 tokens, reading the request's history once for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagekv.core.request import Request
from pagekv.errors import InvalidRequestError

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


class NgramProposer:
    """Drafts for greedy requests: ``num_tokens`` at most per step, by ``NgramIndex``.

    A request is drafted for when it is greedy and asks for no logprobs (the rows a draft adds
    have no sampled distribution to report). Its index lives on the request (derived from its
    tokens, like its block hashes) and is built on its first draft.
    """

    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n or num_tokens < 1:
            raise InvalidRequestError(
                f"n-gram speculation needs num_tokens >= 1 and 1 <= min_n <= max_n, got "
                f"{num_tokens}, {min_n}, {max_n}",
                "num_speculative_tokens",
            )
        self.num_tokens = num_tokens
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, request: Request, limit: int) -> list[int]:
        """Draft tokens to follow ``request``'s last token: at most ``min(num_tokens, limit)``."""
        limit = min(limit, self.num_tokens)
        if limit < 1:
            return []
        index = request.ngram_index
        if index is None:
            params = request.params
            if not params.greedy or params.logprobs is not None:
                return []
            index = request.ngram_index = NgramIndex(self.max_n)
        return index.draft(request.all_token_ids, self.min_n, limit)


def accept(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a drafted step yields: ``targets[i]`` is the model's choice after the i-th
    token fed (the last real token, then each draft). Drafts are kept while the model agrees;
    the first disagreement, or the token after the last draft, ends the list."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} targets, got {len(targets)}")
    kept = 0
    while kept < len(drafts) and targets[kept] == drafts[kept]:
        kept += 1
    return list(targets[: kept + 1])
