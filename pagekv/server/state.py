"""``ServerState``: what every handler needs, built once per app. Owns nothing it creates."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagekv.engine.llm_engine import LLMEngine
from pagekv.errors import InvalidRequestError
from pagekv.server.clients import ClientLedger
from pagekv.server.engine_loop import EngineLoop
from pagekv.server.errors import ModelNotFoundError
from pagekv.server.formats import TokenNamer
from pagekv.server.metrics import Metrics
from pagekv.server.settings import ServerConfig

# A chat template: (messages, add_generation_prompt, tools) -> the prompt's text.
RenderChat = Callable[[list[dict[str, Any]], bool, list[dict[str, Any]] | None], str]


@dataclass
class ServerState:
    """The engine loop and the read-only facts handlers use without asking the engine thread.

    ``tokenizer`` is the engine's tokenizer, immutable after load, so handlers may render chat
    templates and spell logprob tokens with it. ``context_tokens``: prompt + output tokens one
    request may hold (the model's context, capped by the KV pool). ``clients``: what each
    client has in flight (the event loop's). ``hash_secret``: keys the prefix hashes this
    server shows (``shown_hash``), so that nobody outside can test a guessed prompt against them.
    """

    loop: EngineLoop
    config: ServerConfig
    metrics: Metrics
    model_name: str
    model_names: tuple[str, ...]
    tokenizer: Any
    render_chat: RenderChat
    context_tokens: int
    namer: TokenNamer
    clients: ClientLedger
    hash_secret: bytes
    priority_scheduling: bool = False  # --scheduling-policy priority: requests' priority counts

    @classmethod
    def create(
        cls,
        engine: LLMEngine,
        config: ServerConfig,
        loop: EngineLoop,
        metrics: Metrics,
        render_chat: RenderChat | None = None,
    ) -> ServerState:
        """Read the engine's facts; call before ``loop.start()`` (then only the thread may)."""
        stats = engine.stats()
        pool_tokens = int(stats["kv_blocks_total"]) * engine.config.block_size
        tokenizer = engine.tokenizer
        names = config.served_model_names or (model_name_of(engine.loaded.path),)
        return cls(
            loop=loop,
            config=config,
            metrics=metrics,
            model_name=names[0],
            model_names=names,
            tokenizer=tokenizer,
            render_chat=render_chat or tokenizer.apply_chat_template,
            context_tokens=min(engine.max_model_len, pool_tokens),
            namer=TokenNamer(lambda ids: tokenizer.decode(ids, skip_special_tokens=False)),
            clients=ClientLedger(config.client_limits),
            hash_secret=os.urandom(16),
            priority_scheduling=engine.config.scheduling_policy == "priority",
        )

    @property
    def defaults(self) -> dict[str, float]:
        """What unset sampling fields take (``--generation-config``), by field name."""
        return dict(self.config.sampling_defaults)

    def check_priority(self, priority: int) -> None:
        """As vLLM: a priority other than 0 needs the priority policy."""
        if priority != 0 and not self.priority_scheduling:
            raise InvalidRequestError(
                "priority: this server does not schedule by priority (--scheduling-policy "
                "priority)",
                "priority",
            )

    def shown_hash(self, block_hash: str) -> str:
        """A prefix block's hash (hex) as this server shows it: keyed by its secret, so equal
        blocks still show equal hashes."""
        mac = hmac.new(self.hash_secret, bytes.fromhex(block_hash), hashlib.sha256)
        return mac.hexdigest()[:32]

    def check_model(self, model: str | None) -> None:
        """A request may omit the model or give one of its names; anything else is a 400."""
        if model is not None and model not in self.model_names:
            names = ", ".join(repr(name) for name in self.model_names)
            raise ModelNotFoundError(
                f"model {model!r} does not exist; this server serves {names}", "model"
            )


def model_name_of(path: str) -> str:
    """``.../SmolLM2-135M-Instruct-Q8_0.gguf`` -> ``SmolLM2-135M-Instruct-Q8_0``."""
    name = os.path.basename(os.path.normpath(path))
    return name.removesuffix(".gguf") or name
