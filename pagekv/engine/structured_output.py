"""Structured output: a request's constraint compiled to a grammar, one matcher per sequence,
and the token masks each step's sampling rows need.

Owns the grammar library's tokenizer (built from the model's tokenizer at the first constrained
request), a bounded cache of compiled grammars, and one matcher per constrained sequence with
the count of output tokens it has consumed. The engine asks for the masks of a plan before
the runner executes it, and advances the matchers with the tokens the step kept.

The library is llguidance: it computes each mask lazily, walking the vocabulary's token trie
with an Earley parser, so compiling a new schema precomputes nothing and never stalls the
batch; it takes JSON schemas, regular expressions, Lark and GBNF grammars; and it needs no
torch. xgrammar precompiles token masks per grammar (its strength on GPUs, a compile stall for
each new schema on a CPU); outlines-core builds a whole automaton index per pattern before the
first token.

A drafted decode needs a mask for every position it feeds: the matcher consumes the drafts one
by one, a mask after each, and rolls back; past the first draft the grammar refuses, the masks
allow everything, because the verified token there already differs from the draft and nothing
after it is kept.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from pagekv.core.plan import ScheduledRequest
from pagekv.errors import InvalidRequestError
from pagekv.models.tokenizer import Tokenizer
from pagekv.sampling_params import StructuredOutputsParams

PARAM = "structured_outputs"
CACHE_SIZE = 256  # compiled grammars kept, most recently used first
# Compact JSON: a small model given free whitespace may emit it until max_tokens.
JSON_OPTIONS: Any = {"whitespace_flexible": False}


@dataclass
class _Sequence:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has seen


class StructuredOutputs:
    """Grammars, matchers and masks for the engine's constrained sequences."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.mask_words = -(-vocab_size // 32)  # a mask row: one bit per token, 32 to a word
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._sequences: dict[str, _Sequence] = {}
        self._pool: llguidance.LLExecutor | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sequences

    def __len__(self) -> int:
        return len(self._sequences)

    # ---- compiling ------------------------------------------------------------------------------

    def compile(self, constraint: StructuredOutputsParams | None) -> str | None:
        """The grammar of ``constraint`` (None: unconstrained); InvalidRequestError naming the
        field if it does not compile. Allocates nothing per request."""
        if constraint is None:
            return None
        key = constraint.key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = self._build(constraint)
        tokenizer = self._library_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if not error:  # it compiles; its first mask shows whether it admits any output
            probe = llguidance.LLMatcher(tokenizer, grammar)
            self._fill(probe, np.empty(self.mask_words, dtype=np.int32))
            if probe.is_error():
                error = "admits no output: " + probe.get_error().strip().splitlines()[0]
        if error:
            raise InvalidRequestError(
                f"{PARAM}.{constraint.kind}: {error.strip()}", f"{PARAM}.{constraint.kind}"
            )
        self._grammars[key] = grammar
        if len(self._grammars) > CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    @staticmethod
    def _build(constraint: StructuredOutputsParams) -> str:
        kind = constraint.kind
        field = f"{PARAM}.{kind}"
        try:
            if kind == "json":
                schema = constraint.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict | bool):
                    raise InvalidRequestError(f"{field}: a schema is a JSON object", field)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_OPTIONS
                )
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(str(constraint.regex))
            if kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(list(constraint.choice or ())))
            return llguidance.grammar_from("grammar", str(constraint.grammar))
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{field}: {exc}", field) from None

    def _library_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend_json(),
                n_vocab=self.vocab_size,
                eos_token=list(self._tokenizer.eos_token_ids),
            )
        return self._ll_tokenizer

    # ---- sequences ------------------------------------------------------------------------------

    def track(self, request_id: str, grammar: str) -> None:
        """Constrain sequence ``request_id`` by ``grammar`` (from ``compile``)."""
        self._sequences[request_id] = _Sequence(
            llguidance.LLMatcher(self._library_tokenizer(), grammar)
        )

    def release(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)

    def advance(self, request_id: str, output_token_ids: list[int]) -> bool:
        """Feed the matcher the output tokens it has not seen; True once the constraint is
        complete (the grammar takes nothing more), or broken (a token it refused, which only
        an unmasked row could draw)."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        new = output_token_ids[seq.consumed :]
        seq.consumed = len(output_token_ids)
        if new and not seq.matcher.consume_tokens(new):
            return True
        return bool(seq.matcher.is_stopped() or seq.matcher.is_error())

    # ---- masks ----------------------------------------------------------------------------------

    def masks(self, scheduled: Iterable[ScheduledRequest]) -> dict[str, np.ndarray]:
        """Per constrained entry that samples this step: int32 [positions, mask_words], one row
        per position it feeds (a drafted decode feeds several), bit t of a row set if token t
        may be drawn there. The first rows of all entries are computed together, in parallel."""
        out: dict[str, np.ndarray] = {}
        first: list[tuple[llguidance.LLMatcher, int]] = []
        entries = []
        for entry in scheduled:
            seq = self._sequences.get(entry.request.request_id)
            if seq is None or not entry.samples:
                continue
            entries.append((entry, seq))
            first.append((seq.matcher, len(first)))
        if not entries:
            return out
        firsts = np.empty((len(first), self.mask_words), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor(), first, firsts)
        for (entry, seq), first_row in zip(entries, firsts, strict=True):
            drafts = entry.draft_token_ids
            rows = np.full((len(drafts) + 1, self.mask_words), -1, dtype=np.int32)
            rows[0] = first_row
            # consuming a token the grammar refuses would break the matcher for good
            taken = seq.matcher.validate_tokens(list(drafts)) if drafts else 0
            for i in range(taken):
                seq.matcher.consume_token(drafts[i])
                self._fill(seq.matcher, rows[i + 1])
            if taken:
                seq.matcher.rollback(taken)
            out[entry.request.request_id] = rows
        return out

    def _executor(self) -> llguidance.LLExecutor:
        if self._pool is None:  # masks are computed between forwards: every core is free
            self._pool = llguidance.LLExecutor(num_threads=len(os.sched_getaffinity(0)))
        return self._pool

    @staticmethod
    def _fill(matcher: llguidance.LLMatcher, row: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
