"""What the engine's configuration imposes on each request's ``SamplingParams`` as it is queued:
a seed for an unseeded sampled request (from ``EngineConfig.seed``) and the logprobs cap
(``EngineConfig.max_logprobs``), as vLLM's engine arguments of those names do. No torch.
"""

from __future__ import annotations

import random
from dataclasses import replace

from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import SamplingParams


class ParamsPolicy:
    """Owns the engine's seed stream: unseeded sampled requests get its next seed, so runs with
    the same seed and the same requests in the same order draw the same tokens (vLLM's seed
    makes a run reproducible the same way). Without a seed they draw from torch's global RNG."""

    def __init__(self, seed: int | None, max_logprobs: int) -> None:
        self._seeds = None if seed is None else random.Random(seed)
        self.max_logprobs = max_logprobs

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against the cap and, if unseeded and sampled, seeded."""
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name, None)
            if asked is not None and asked > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name}: {asked} requested, more than the engine's max_logprobs "
                    f"({self.max_logprobs})",
                    name,
                )
        if self._seeds is None or params.seed is not None or params.temperature == 0:
            return params
        return replace(params, seed=self._seeds.getrandbits(63))
