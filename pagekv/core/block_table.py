"""Block tables: each request's map from logical blocks to physical blocks, device or host.

Owns: every request's ``Table`` (its blocks, and how many of them the prefix cache knows), on
the device, or on the host while the request is swapped out; a request holds one or the other.
The KV cache manager decides what goes in them (allocation, growth, fork, copy-on-write, swap);
the ``BlockPool``s own the blocks' reference counts. Must not import torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagekv.core.request import Request
from pagekv.errors import InvalidRequestError, UnknownRequestError

# The table entry of a logical block given back under a sliding window: its positions are
# before every later query's window, so nothing reads them again.
NO_BLOCK = -1


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass
class Table:
    """A request's block table: logical block i -> physical block ``blocks[i]``.

    Under a sliding window the first ``num_dropped`` entries are ``NO_BLOCK`` (given back);
    the rest, ``live``, are held blocks. Positions keep their logical blocks either way."""

    request: Request
    blocks: list[int]
    num_committed: int = 0  # blocks[:num_committed] are known to the prefix cache
    num_dropped: int = 0

    @property
    def live(self) -> list[int]:
        return self.blocks[self.num_dropped :] if self.num_dropped else self.blocks


class BlockTables:
    """The device tables, and the host tables of swapped-out requests, by request id."""

    def __init__(self) -> None:
        self.device: dict[str, Table] = {}
        self.host: dict[str, Table] = {}

    # ---- queries --------------------------------------------------------------------------------

    def has_table(self, request_id: str) -> bool:
        return request_id in self.device

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.host

    def block_table(self, request_id: str) -> list[int]:
        return self.lookup(request_id).blocks

    def host_block_table(self, request_id: str) -> list[int]:
        return self.lookup_host(request_id).blocks

    def request_ids(self) -> list[str]:
        return list(self.device)

    def swapped_request_ids(self) -> list[str]:
        return list(self.host)

    def block_owners(self) -> dict[int, list[str]]:
        """Device block -> the requests whose tables point at it."""
        owners: dict[int, list[str]] = {}
        for rid, table in self.device.items():
            for block_id in table.live:
                owners.setdefault(block_id, []).append(rid)
        return owners

    def num_held(self, request_id: str) -> int:
        """The blocks a request holds, device or (swapped out) host: its live entries."""
        table = self.device.get(request_id) or self.lookup_host(request_id)
        return len(table.blocks) - table.num_dropped

    def table_fills(self) -> Iterator[tuple[list[int], int]]:
        """Each device table's blocks and its request's computed tokens."""
        return ((t.blocks, t.request.num_computed_tokens) for t in self.device.values())

    def lookup(self, request_id: str) -> Table:
        table = self.device.get(request_id)
        if table is None:
            raise UnknownRequestError(f"request {request_id!r} holds no device blocks")
        return table

    def lookup_host(self, request_id: str) -> Table:
        table = self.host.get(request_id)
        if table is None:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out")
        return table

    def check_unheld(self, request_id: str) -> None:
        if request_id in self.device or request_id in self.host:
            raise InvalidRequestError(f"request {request_id!r} already holds blocks", "request_id")

    # ---- changes (the manager's) ----------------------------------------------------------------

    def add(
        self,
        request: Request,
        blocks: Sequence[int],
        num_committed: int = 0,
        num_dropped: int = 0,
    ) -> None:
        """Give ``request`` a device table over ``blocks`` (a list of its own), the first
        ``num_dropped`` of them ``NO_BLOCK``."""
        self.device[request.request_id] = Table(request, list(blocks), num_committed, num_dropped)

    def add_host(self, request: Request, blocks: Sequence[int], num_dropped: int = 0) -> None:
        """Give a swapped-out ``request`` a host table over ``blocks``."""
        self.host[request.request_id] = Table(request, list(blocks), 0, num_dropped)

    def pop(self, request_id: str) -> Table | None:
        return self.device.pop(request_id, None)

    def pop_host(self, request_id: str) -> Table | None:
        return self.host.pop(request_id, None)
