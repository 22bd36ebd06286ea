"""The engine layer: a request's life around ``LLMEngine.step()``.

    llm_engine.py     LLMEngine: add_request / abort_request / step (schedule, execute, update)
    request_group.py  a user request and its n branches; outputs, stop strings
    beam_search.py    BeamSearchParams / BeamSearchOutput; beam_driver.py runs the beams
    detokenizer.py    incremental text from token ids
    outputs.py        RequestOutput / CompletionOutput (what the server and LLM API return)
    sanitizer.py      the KV sanitizer (no write into a shared block; shared K/V never changes)
    structured_output.py  grammars and the token masks of constrained requests
    block_map.py      the device block map as JSON data (what /debug/kv draws)
    tier_setup.py     the host pool and storage tier, wired from the config
    device.py         where the model runs: CPU or a CUDA GPU
    config.py         EngineConfig; args.py maps command-line flags onto it; vllm_forms.py reads
                      vLLM's spellings of its values ("4k", dtype "half", swap space in GiB)
    llm_args.py       LLM(...)'s keyword arguments as vLLM takes them, onto an EngineConfig
    model_setup.py    which weights the engine loads (path, HF id, quantization, int8 activations)
    request_params.py what the config imposes on each request's params (seed, max_logprobs)
    prompts.py        prompts as token ids, checked; vLLM's prompt forms (pagekv.inputs)

``LLMEngine`` pulls in torch, so it is loaded on first use: importing the plain types
(config, outputs, beam-search parameters) stays light.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagekv.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from pagekv.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagekv.engine' has no attribute {name!r}")
