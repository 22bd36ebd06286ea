"""One sequence's logical state: its tokens, how many are computed, its status.

Owns: the token ids in logical order and ``num_computed_tokens``; the engine creates requests,
the scheduler moves them between queues and advances ``num_computed_tokens``. The physical side
(block table) is owned by the KV cache manager, keyed by ``request_id``. Must not import torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import Enum

from pagekv.core.block_pool import BlockHash
from pagekv.core.ngram_index import NgramIndex
from pagekv.errors import InvariantError
from pagekv.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    FORK_PENDING = "fork_pending"  # a branch of n > 1, created when its parent's prompt is in
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


class Request:
    """A sequence being generated. ``all_token_ids`` = prompt + output, in logical order.

    The one rule of scheduling: a request has ``num_computed_tokens`` (K/V in the cache) and a
    target ``num_tokens``; each step hands it tokens until they meet. Prefill, chunked prefill,
    prefix-cache hits and resumption after preemption are all this rule.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        eos_token_ids: Sequence[int] = (),
        client: str | None = None,
        bad_words_token_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.priority = priority
        self.client = client  # whose request (the fair policy's turns and shares); None: one
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hit at first admission (usage reports)
        self.num_preemptions = 0
        self.eos_token_ids = tuple(eos_token_ids)  # the tokenizer's, given by the engine
        # params.bad_words as token sequences, tokenized by the engine (the sampler bars them)
        self.bad_words_token_ids = tuple(tuple(word) for word in bad_words_token_ids)
        # Branches to fork off once the prompt, all but its last token, is computed: they share
        # every prompt block, and each computes the last token itself (copy-on-write).
        self.fork_children: list[Request] = []
        # A beam that has reported its next-token candidates waits, its provisional last token
        # uncomputed, until every beam of its group has reported and the survivors are chosen.
        self.held = False
        # Keys of this sequence's full blocks (prefix_cache.extend_hash_chain); derived from the
        # tokens, kept here so a waiting request does not rehash every time it is considered.
        self.block_hashes: list[BlockHash] = []
        # Where each n-gram of its tokens last occurred, for drafting (speculation.py); built
        # on the first draft, None for requests never drafted for.
        self.ngram_index: NgramIndex | None = None

    @property
    def reads_prefix_cache(self) -> bool:
        """False for a request that asks for prompt logprobs: a prefix hit would skip the
        positions whose logits it needs (vLLM v1 skips the cache for them too)."""
        return self.params.prompt_logprobs is None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_target_tokens(self) -> int:
        """Where the scheduler stops handing out tokens: before the last token while branches
        wait to be forked (so each samples its own next token) or while a beam is held, else
        the end. A request with nothing to do this step is skipped."""
        return self.num_tokens - 1 if self.fork_children or self.held else self.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def replace_last_token(self, token_id: int) -> None:
        """Swap the last token for another: a held beam's provisional token becomes the one
        its group chose. Only an uncomputed token may change (no K/V was written for it)."""
        if self.num_computed_tokens >= self.num_tokens:
            raise InvariantError(f"{self.request_id}: the last token is already computed")
        self.all_token_ids[-1] = token_id

    def hold(self) -> None:
        """Stop short of the last token (a beam that reported its candidates waits for its
        siblings); it keeps its blocks and is skipped until ``release_hold``."""
        self.held = True

    def release_hold(self) -> None:
        """Let the scheduler compute the last token again (the beam's survivors are chosen)."""
        self.held = False

    def branch_off(self, request_id: str, last_token_id: int) -> Request:
        """A new sequence: this one's tokens with ``last_token_id`` as its uncomputed last
        (a beam chosen twice), pending as a fork child until ``Scheduler.fork`` shares this
        request's blocks with it. It shares the prompt list, which is never written: beams of
        one search differ in their output only."""
        child = Request(
            request_id,
            [*self.all_token_ids[:-1], last_token_id],
            self.params,
            cache_salt=self.cache_salt,
            priority=self.priority,
            eos_token_ids=self.eos_token_ids,
            client=self.client,
        )
        child.prompt_token_ids = self.prompt_token_ids
        self.fork_children.append(child)
        return child

    def stop_status(self, token_id: int) -> RequestStatus | None:
        """The finish status after sampling ``token_id``, if it ends the request (token level)."""
        params = self.params
        num_output = self.num_output_tokens
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
