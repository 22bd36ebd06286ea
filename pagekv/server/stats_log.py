"""vLLM's periodic stats line, every ``LogSettings.stats_interval_s`` (10 s) while there is work:

    Engine 000: Avg prompt throughput: 120.5 tokens/s, Avg generation throughput: 48.2 tokens/s,
    Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 4.1%, Prefix cache hit rate: 37.5%

Prompt throughput counts the prompt tokens computed (not those found in the prefix cache), as
vLLM's does; the hit rate is over the prompt tokens looked up since the last line (omitted
until some were). A line whose interval and the one before had no tokens and nothing running
or waiting is not written (vLLM writes it at debug), so an idle server is quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagekv.engine.llm_engine import LLMEngine
from pagekv.errors import PagekvError
from pagekv.server.engine_loop import EngineLoop, TokenCounts

logger = logging.getLogger("pagekv.stats")


@dataclass
class _Snapshot:
    time_s: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0


def _preemptions(stats: Mapping[str, Any]) -> int:
    return int(stats.get("preemptions_recompute", 0)) + int(stats.get("preemptions_swap", 0))


class StatsLine:
    """Owns the previous interval's counts; ``line`` makes the next line (None: idle)."""

    def __init__(self, tokens: TokenCounts, now_s: float) -> None:
        self.tokens = tokens
        self._last = _Snapshot(now_s)
        self._last_busy = False
        self._hit_rate: float | None = None

    def line(self, stats: Mapping[str, Any], now_s: float) -> str | None:
        now = _Snapshot(
            now_s,
            self.tokens.prompt_tokens,
            self.tokens.generation_tokens,
            int(stats.get("prefix_cache_query_tokens", 0)),
            int(stats.get("prefix_cache_hit_tokens", 0)),
            _preemptions(stats),
        )
        last, self._last = self._last, now
        seconds = max(now.time_s - last.time_s, 1e-9)
        prompt = (now.prompt_tokens - last.prompt_tokens) / seconds
        generation = (now.generation_tokens - last.generation_tokens) / seconds
        running, waiting = int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0))
        busy = bool(prompt or generation or running or waiting)
        was_busy, self._last_busy = self._last_busy, busy
        queries = now.prefix_queries - last.prefix_queries
        if queries > 0:
            self._hit_rate = (now.prefix_hits - last.prefix_hits) / queries
        if not (busy or was_busy):
            return None
        parts = [
            f"Avg prompt throughput: {prompt:.1f} tokens/s",
            f"Avg generation throughput: {generation:.1f} tokens/s",
            f"Running: {running} reqs",
            f"Waiting: {waiting} reqs",
        ]
        if now.preemptions > last.preemptions:
            parts.append(f"Preemptions: {now.preemptions - last.preemptions}")
        parts.append(f"KV cache usage: {100 * float(stats.get('kv_usage', 0.0)):.1f}%")
        if self._hit_rate is not None:
            parts.append(f"Prefix cache hit rate: {100 * self._hit_rate:.1f}%")
        return "Engine 000: " + ", ".join(parts)


async def log_stats(loop: EngineLoop, interval_s: float) -> None:
    """Write the stats line every ``interval_s`` until cancelled or the engine stops."""
    stats_line = StatsLine(loop.tokens, time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        try:
            stats = await loop.call(LLMEngine.stats)
        except PagekvError:  # the engine thread stopped: nothing more to report
            return
        line = stats_line.line(stats, time.monotonic())
        if line is not None:
            logger.info(line)
