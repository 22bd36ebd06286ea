"""`pagekv serve` on a device, driven by the official `openai` client: a chat completion, a
streamed completion, a bad request (a 400 with nothing left behind, the server still up), and
`/metrics`. The server binds 127.0.0.1 and is stopped by its PID.

    python benchmarks/gpu_serve_check.py                  # --device cuda (gpu_check.sh)
    python benchmarks/gpu_serve_check.py --device cpu     # the same check on the CPU

Exits non-zero when any step fails.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai


def wait_until_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=1)
            return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    raise RuntimeError(f"the server did not answer within {timeout_s} s")


def check(client: openai.OpenAI, url: str) -> None:
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    text = chat.choices[0].message.content or ""
    print(f"chat: {text!r} ({chat.usage.completion_tokens if chat.usage else '?'} tokens)")
    assert text.strip(), "an empty chat completion"
    chunks = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=16, stream=True, temperature=0
    )
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    print(f"stream: {streamed!r}")
    assert streamed.strip(), "an empty stream"
    try:
        client.completions.create(model=model, prompt="x", max_tokens=-3)
    except openai.BadRequestError as error:
        print(f"max_tokens=-3: {error.status_code}")
    else:
        raise AssertionError("max_tokens=-3 was accepted")
    metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
    print(f"/metrics: {metrics.count(chr(10))} lines")
    assert "pagekv_kernels_info" in metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "pagekv.cli", "serve", "--device", args.device]
    command += ["--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(args.port)]
    proc = subprocess.Popen(command)
    try:
        wait_until_up(url, proc, args.timeout_s)
        check(openai.OpenAI(base_url=f"{url}/v1", api_key="unused"), url)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
