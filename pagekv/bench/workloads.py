"""The standard benchmark workloads: fixed token-id prompts and exact output lengths.

Owns the definitions only (numpy, no torch, no engine), so pagekv, Hugging Face transformers
and vLLM are fed byte-identical requests. Prompts are raw token ids: no BOS, no chat template.
Every request generates exactly its ``output_len`` tokens (greedy, ignore_eos).

    random  64 requests, prompt 32..512 and output 16..256 tokens, one rng(0) stream
    prefix  64 requests sharing a 256-token prefix + 32 unique tokens, 64 output tokens each
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

RANDOM_PROMPT_TOKENS = 17_709
RANDOM_OUTPUT_TOKENS = 8_885
WORKLOAD_NAMES = ("random", "prefix")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


def random_workload() -> Workload:
    """Prompt and output lengths first, then each prompt's ids, all from one rng(0)."""
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(32, 512, size=64, endpoint=True)
    output_lens = rng.integers(16, 256, size=64, endpoint=True)
    requests = [
        BenchRequest(
            rng.integers(100, 10000, size=int(prompt_lens[i]), endpoint=True).tolist(),
            int(output_lens[i]),
        )
        for i in range(64)
    ]
    workload = Workload("random", requests)
    assert workload.num_prompt_tokens == RANDOM_PROMPT_TOKENS, workload.num_prompt_tokens
    assert workload.num_output_tokens == RANDOM_OUTPUT_TOKENS, workload.num_output_tokens
    return workload


def prefix_workload() -> Workload:
    """One 256-token prefix shared by 64 prompts, each with 32 unique tokens after it."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 10000, size=256, endpoint=True).tolist()
    suffixes = rng.integers(100, 10000, size=(64, 32), endpoint=True).tolist()
    return Workload("prefix", [BenchRequest(prefix + s, 64) for s in suffixes])


def load_workload(name_or_path: str) -> Workload:
    """``random``, ``prefix``, or a JSON file: ``[{"prompt_token_ids": [...], "output_len": n}]``.

    Raises ValueError on a malformed file (no request, an empty prompt, a length < 1).
    """
    if name_or_path == "random":
        return random_workload()
    if name_or_path == "prefix":
        return prefix_workload()
    with open(name_or_path, encoding="utf-8") as f:
        items = json.load(f)
    if not isinstance(items, list) or not items:
        raise ValueError(f"{name_or_path}: expected a non-empty JSON list of requests")
    requests = []
    for i, item in enumerate(items):
        ids, out_len = item.get("prompt_token_ids"), item.get("output_len")
        if not isinstance(ids, list) or not ids or not isinstance(out_len, int) or out_len < 1:
            raise ValueError(
                f"{name_or_path}: request {i} needs a non-empty prompt_token_ids list and "
                f"an output_len >= 1"
            )
        requests.append(BenchRequest([int(t) for t in ids], out_len))
    return Workload(name_or_path, requests)
