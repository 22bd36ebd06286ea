"""Speculative decoding by n-gram lookup: draft tokens from the sequence's own history.

Owns the rule of what to draft and what to accept; the scheduler asks for drafts when it
schedules a decode, the runner computes the model's greedy token at every drafted position, and
``accept`` keeps the drafts up to the first that the model disagrees with. Greedy requests only:
what is accepted is exactly what decoding one token at a time would have produced, so a draft
costs compute, never correctness. The lookup itself is ``NgramIndex``'s (``ngram_index.py``).
Must not import torch.

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

from pagekv.core.ngram_index import NgramIndex
from pagekv.core.request import Request
from pagekv.errors import InvalidRequestError


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

    def propose_for_decode(self, request: Request, budget: int) -> tuple[int, ...]:
        """Drafts for a decode at the end of its tokens, within the token ``budget`` the
        scheduler has left after it (one token per running request behind it), and short of
        ``max_tokens``. None for a prefill or a parent about to fork its branches."""
        if request.fork_children or request.num_computed_tokens != request.num_tokens - 1:
            return ()
        remaining = request.params.max_tokens - request.num_output_tokens - 1
        return tuple(self.propose(request, min(budget, remaining)))

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
