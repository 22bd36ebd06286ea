"""Peak resident memory of a loaded engine, minus its KV pool, per way of keeping the weights.

    python benchmarks/bench_weights_rss.py [--model FILE.gguf] [--record]

Each setting runs in a fresh process: load the engine with a small KV pool, generate a few
tokens (so every weight has been read and packed), and report the process's peak RSS, the KV
pool's bytes, and their difference beside the weights' bytes the engine reports. A process that
imports the same modules, loads the tokenizer and runs one torch matmul, with no weights, is the
floor under them all (the interpreter, torch, the C kernels' libraries, the vocabulary).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

SETTINGS = [
    ("GGUF blocks, float32 activations", {"quantization": "gguf", "dtype": "float32"}),
    ("dequantized bfloat16", {"quantization": "none", "dtype": "bfloat16"}),
    ("dequantized float32", {"quantization": "none", "dtype": "float32"}),
]

_ENGINE = """
import json, resource, sys
from pagekv import SamplingParams
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.kernels import report
settings = json.loads(sys.argv[1])
engine = LLMEngine(EngineConfig(num_kv_blocks=64, **settings))
engine.add_request("r", "The capital of France is", SamplingParams(temperature=0, max_tokens=16))
while engine.has_unfinished_requests():
    engine.step()
kv = engine.runner.kv
pool = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({
    "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss": int(status["VmRSS"].split()[0]) * 1024,
    "kv_pool": pool,
    "weights": engine.runner.kernels.get("weights", ""),
}))
"""

_FLOOR = """
import json, resource, sys, torch  # noqa: E401
from pagekv.engine import LLMEngine  # noqa: F401  (the engine's imports, no model)
from pagekv.kernels import decode, fused_ops
from pagekv.models.gguf_file import GGUFFile
from pagekv.models.loader import default_model_path
from pagekv.models.tokenizer import tokenizer_from_gguf
decode.load(); fused_ops.load()
path = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else default_model_path()
tokenizer = tokenizer_from_gguf(GGUFFile(path).metadata, path)
torch.randn(64, 576) @ torch.randn(576, 1536)
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _run(code: str, *args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], check=True, capture_output=True, text=True
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    record.add_argument(parser)
    args = parser.parse_args()
    floor = int(_run(_FLOOR, args.model or "")["peak_rss"])  # type: ignore[call-overload]
    print(f"floor (interpreter, torch, kernels, tokenizer; no weights): {floor / 2**20:.1f} MiB")
    columns = ["weights", "peak RSS", "RSS after", "KV pool"]
    columns += ["peak - KV - floor", "after - KV - floor"]
    print("| " + " | ".join(columns) + " | (MiB)")
    print("|" + " --- |" * len(columns))
    rows: list[list[record.Cell]] = []
    for name, settings in SETTINGS:
        if args.model:
            settings = {**settings, "model": args.model}
        r = _run(_ENGINE, json.dumps(settings))
        peak, now = int(r["peak_rss"]), int(r["rss"])  # type: ignore[call-overload]
        pool = int(r["kv_pool"])  # type: ignore[call-overload]
        mib = [
            round(b / 2**20, 1) for b in (peak, now, pool, peak - pool - floor, now - pool - floor)
        ]
        rows.append([f"{name} ({r['weights']})", *mib])
        print("| " + " | ".join(str(cell) for cell in rows[-1]) + " |")
    if args.record is not None:
        record.save(
            args.record or "weights_rss",
            "Resident memory of the weights per way of keeping them",
            [columns[0], *(f"{c} (MiB)" for c in columns[1:])],
            rows,
            f"A fresh process per row: an engine with a 64-block KV pool generates 16 tokens; the "
            f"floor ({floor / 2**20:.1f} MiB) is the same imports, tokenizer and kernels without "
            "weights. Compare the last columns with the weights' bytes in the first.",
        )


if __name__ == "__main__":
    main()
