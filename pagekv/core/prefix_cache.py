"""Prefix-cache keys: the hash chain over full blocks of a token sequence.

Owns nothing; pure functions. Must not import torch.

A block's key commits to everything before it, so equal keys mean equal K/V::

    root   = H("root", salt)                    one root per cache_salt: tenants never share
    key[0] = H("block", root,   tokens[0:B])
    key[i] = H("block", key[i-1], tokens[i*B:(i+1)*B])

Every field is tagged and length-prefixed before it is hashed (domain separation), so no salt
string can be read as a token sequence, and no token sequence as a parent key. blake2b is
cryptographic: a collision, which would silently serve another prompt's K/V, is not a risk.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from pagekv.core.block_pool import BlockHash

_PERSON = b"pagekv.kv.v1"
_DIGEST_BYTES = 16


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + len(payload).to_bytes(8, "little") + payload


def root_hash(cache_salt: str | None) -> BlockHash:
    """The parent key of a sequence's first block; distinct for every salt (and for none)."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    h = hashlib.blake2b(_field(b"R", salt), digest_size=_DIGEST_BYTES, person=_PERSON)
    return h.digest()


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Key of one full block: its parent's key plus its token ids."""
    tokens = array("q", token_ids).tobytes()
    h = hashlib.blake2b(_field(b"P", parent), digest_size=_DIGEST_BYTES, person=_PERSON)
    h.update(_field(b"T", tokens))
    return h.digest()


def extend_hash_chain(
    chain: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> None:
    """Append keys for every full block of ``token_ids`` that ``chain`` does not cover yet."""
    num_full = len(token_ids) // block_size
    parent = chain[-1] if chain else root_hash(cache_salt)
    for i in range(len(chain), num_full):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        chain.append(parent)
