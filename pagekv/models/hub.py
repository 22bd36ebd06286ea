"""A Hugging Face model id ("HuggingFaceTB/SmolLM2-135M-Instruct") resolved to a local path,
offline, from the local Hugging Face cache. Never downloads anything.

Owns nothing: functions of the file system and the environment. The cache is found as
huggingface_hub finds it (``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else
``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``)
and read in its layout:

    <cache>/models--<org>--<name>/refs/main           the commit the "main" branch points to
    <cache>/models--<org>--<name>/snapshots/<commit>/  that commit's files (links to blobs/)

A snapshot holding config.json and safetensors weights is loaded as an HF directory; else its
GGUF file (with several, the id says which: "org/name:Q4_K_M" picks the one whose name holds
Q4_K_M, as vLLM reads it). Anything else raises ``ModelLoadError`` naming every place looked.
"""

from __future__ import annotations

import glob
import os
import re

from pagekv.errors import ModelLoadError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_cache_dir() -> str:
    """The local Hugging Face hub cache, from the environment as huggingface_hub reads it."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return os.path.expanduser(os.environ[variable])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` could be an "org/name" id (a path to nothing here may still be one)."""
    return _REPO_ID.fullmatch(name.split(":", 1)[0]) is not None


def resolve_model_path(name: str, *, need_weights: bool = True) -> str:
    """``name`` itself when it exists here; else the file or directory the local HF cache holds
    for it (``need_weights=False``: any snapshot with a tokenizer will do)."""
    if os.path.exists(name):
        return name
    if not looks_like_repo_id(name):
        raise ModelLoadError(f"{name}: no such file or directory")
    repo_id, _, quant = name.partition(":")
    cache = hub_cache_dir()
    repo_dir = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    looked = (
        f"looked for the path {os.path.abspath(name)!r} and in the local Hugging Face cache at "
        f"{repo_dir!r} (HF_HUB_CACHE / HF_HOME set where the cache is; nothing is downloaded)"
    )
    snapshot = _snapshot(repo_dir, looked, name)
    if need_weights:
        return _weights_in(snapshot, quant, name)
    if os.path.isfile(os.path.join(snapshot, "tokenizer.json")):
        return snapshot
    return _weights_in(snapshot, quant, name)  # a GGUF file carries its tokenizer


def _snapshot(repo_dir: str, looked: str, name: str) -> str:
    """The snapshot "main" points to, or the only one there is."""
    snapshots = os.path.join(repo_dir, "snapshots")
    if not os.path.isdir(snapshots):
        raise ModelLoadError(f"model {name!r} not found: {looked}")
    ref = os.path.join(repo_dir, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
        path = os.path.join(snapshots, commit)
        if os.path.isdir(path):
            return path
    found = sorted(os.listdir(snapshots))
    if len(found) == 1:
        return os.path.join(snapshots, found[0])
    raise ModelLoadError(
        f"model {name!r}: {repo_dir} has no refs/main snapshot to choose among {found or 'none'}"
    )


def _weights_in(snapshot: str, quant: str, name: str) -> str:
    """The snapshot as an HF directory (config.json + safetensors), else its GGUF file."""
    has_config = os.path.isfile(os.path.join(snapshot, "config.json"))
    if not quant and has_config and glob.glob(os.path.join(snapshot, "*.safetensors")):
        return snapshot
    ggufs = sorted(glob.glob(os.path.join(snapshot, "**", "*.gguf"), recursive=True))
    chosen = [g for g in ggufs if quant.lower() in os.path.basename(g).lower()]
    if len(chosen) == 1:
        return chosen[0]
    shown = [os.path.relpath(g, snapshot) for g in ggufs]
    if len(chosen) > 1:
        raise ModelLoadError(
            f"model {name!r}: {snapshot} holds several GGUF files {shown}; name one as "
            f"'{name.split(':')[0]}:<quant>' (e.g. ':{_quant_of(shown[0])}') or pass its path"
        )
    what = f"no GGUF file matching {quant!r} (it has {shown})" if quant else "no model weights"
    raise ModelLoadError(
        f"model {name!r}: the cached snapshot {snapshot} holds {what} (config.json with "
        "*.safetensors, or a .gguf file, are loaded; .bin weights are not)"
    )


def _quant_of(file_name: str) -> str:
    stem = os.path.basename(file_name).removesuffix(".gguf")
    return stem.rsplit(".", 1)[-1] if "." in stem else stem.rsplit("-", 1)[-1]
