"""Typed errors of pagekv, shared by every layer (this module imports nothing).

Three kinds, as STYLE.md asks:
- bad user input is a ``ValueError`` subclass raised before anything is allocated;
- running out of blocks is normal flow (``NoFreeBlocksError`` is for callers that asked to be told);
- a broken invariant is a bug: ``InvariantError`` carries a dump of the offending blocks.
"""


class PagekvError(Exception):
    """Base of every error pagekv raises on purpose."""


class InvalidRequestError(PagekvError, ValueError):
    """A request or parameter the user gave is invalid; nothing was allocated."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) can never fit the model's context or the KV pool."""


class ModelLoadError(PagekvError, ValueError):
    """A model path is missing, of an unknown layout, or corrupt."""


class BlockError(PagekvError, ValueError):
    """A block id that the pool does not know, or a block freed twice."""


class UnknownBlockError(BlockError):
    """A block id outside the pool."""


class DoubleFreeError(BlockError):
    """A block whose reference count is already zero was freed again."""


class UnknownRequestError(PagekvError, KeyError):
    """A request id the KV cache manager holds no blocks for."""


class NoFreeBlocksError(PagekvError):
    """Not enough free or evictable blocks (normal flow: the scheduler preempts)."""


class InvariantError(PagekvError, AssertionError):
    """A memory-manager invariant is broken: a bug, never user error. The message is a dump."""
