"""lm-evaluation-harness (``lm-eval``, PyPI) against ``pagekv serve`` (issue #58, point 2).

Two tasks of ``tests/server/lm_eval_tasks/`` over local JSONL files (nothing downloaded):
``pagekv_choice`` (multiple choice: each choice's log-likelihood, which lm-eval's
``local-completions`` model asks for as ``echo`` + ``logprobs`` with ``max_tokens`` 1) and
``pagekv_gen`` (greedy ``generate_until``). Each runs twice through ``lm_eval.simple_evaluate``
with ``log_samples``: on the server (the default model on the exact path, ``--gguf-activations
dtype``, float32), and on the harness's own ``hf`` model, transformers float32 on the same
weights (the GGUF as transformers dequantizes it, saved as an HF directory). Per choice the
log-likelihoods agree within 1e-3, and the greedy texts are equal.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.server.support import REPO, ServerProcess, nothing_in_use, start_server, wait_until

pytestmark = [pytest.mark.model, pytest.mark.slow]

TASKS_DIR = REPO / "tests" / "server" / "lm_eval_tasks"
TASKS = ["pagekv_choice", "pagekv_gen"]
LOGLIKELIHOOD_TOLERANCE = 1e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def hf_dir(hf_model: Any, hf_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default GGUF as transformers dequantizes it, float32, as an HF directory."""
    import transformers

    out = tmp_path_factory.mktemp("hf-float32")
    # a GGUF-loaded model refuses save_pretrained ("quantized with gguf") though its weights are
    # dequantized floats: copy them into a plain model built from the same config
    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(out)
    hf_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No downloads; datasets' cache in a tmp dir; the repository as the working directory
    (the tasks' data_files are relative to it)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in OFFLINE.items():
            mp.setenv(name, value)
        cache = tmp_path_factory.mktemp("hf-datasets")
        mp.setenv("HF_DATASETS_CACHE", str(cache))
        import datasets  # reads the variables above at its first import; set them if it had

        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        mp.chdir(REPO)
        yield


def evaluate(model: str, model_args: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Both tasks' logged samples by task, in document order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        num_fewshot=0,
        batch_size=1,
        log_samples=True,
    )
    assert results is not None
    samples: dict[str, list[dict[str, Any]]] = results["samples"]
    return {task: sorted(samples[task], key=lambda s: s["doc_id"]) for task in TASKS}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("server")
    proc = start_server(log_dir, "--gguf-activations", "dtype", "--dtype", "float32")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def served(server: ServerProcess, hf_dir: Path, offline: None) -> dict[str, list[dict[str, Any]]]:
    model = server.get("/v1/models").json()["data"][0]["id"]
    model_args = {
        "model": model,
        "base_url": server.url + "/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(hf_dir),
        "num_concurrent": 1,
        "max_retries": 1,  # a refused request fails the test at once
        "timeout": 120,
    }
    return evaluate("local-completions", model_args)


@pytest.fixture(scope="module")
def reference(hf_dir: Path, offline: None) -> dict[str, list[dict[str, Any]]]:
    return evaluate("hf", {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"})


def loglikelihoods(sample: dict[str, Any]) -> list[float]:
    """A multiple-choice sample's log-likelihood per choice (resps: [[(ll, is_greedy)], ...])."""
    return [float(resp[0][0]) for resp in sample["resps"]]


def greedy_flags(sample: dict[str, Any]) -> list[bool]:
    """Per choice: is each continuation token the top-1 one (the server's from top_logprobs)."""
    return [bool(resp[0][1]) for resp in sample["resps"]]


def test_loglikelihoods_equal_transformers(
    served: dict[str, list[dict[str, Any]]], reference: dict[str, list[dict[str, Any]]]
) -> None:
    ours, theirs = served["pagekv_choice"], reference["pagekv_choice"]
    assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] == list(range(30))
    deltas = []
    for a, b in zip(ours, theirs, strict=True):
        assert a["arguments"] == b["arguments"]  # the same (context, continuation) pairs
        assert greedy_flags(a) == greedy_flags(b), (a["doc_id"], a["arguments"])
        for x, y in zip(loglikelihoods(a), loglikelihoods(b), strict=True):
            deltas.append(abs(x - y))
            assert abs(x - y) <= LOGLIKELIHOOD_TOLERANCE, (a["doc_id"], a["arguments"], x, y)
    print(f"max |delta loglikelihood| over {len(deltas)} choices: {max(deltas):.2e}")
    assert len(deltas) > 100


def test_greedy_generations_equal_transformers(
    served: dict[str, list[dict[str, Any]]], reference: dict[str, list[dict[str, Any]]]
) -> None:
    ours, theirs = served["pagekv_gen"], reference["pagekv_gen"]
    assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] == list(range(24))
    texts = [s["resps"][0][0] for s in ours]
    assert texts == [s["resps"][0][0] for s in theirs]
    assert sum(bool(t.strip()) for t in texts) >= len(texts) // 2  # mostly real answers


def test_nothing_left_allocated(served: dict[str, Any], server: ServerProcess) -> None:
    assert wait_until(lambda: nothing_in_use(server), timeout_s=10), server.kv()["stats"]
