"""Choosing the device: the CPU unless CUDA is asked for (or ``auto`` finds a GPU); where
CUDA is asked for and absent, a clear error before anything is loaded."""

from __future__ import annotations

import pytest
import torch

from pagekv import cli
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.engine.device import resolve_device
from pagekv.errors import InvalidRequestError

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


def test_auto_and_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@no_gpu
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match="sees no CUDA GPU here; use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(InvalidRequestError, match="sees no CUDA GPU") as info:
        LLMEngine(EngineConfig(device="cuda"))
    assert info.value.param == "device"


@no_gpu
def test_cli_says_so_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["generate", "Hello", "--device", "cuda", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert status != 0
    assert "sees no CUDA GPU" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("field", "value"),
    [("device", "gpu"), ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5)],
)
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]
