"""Hypothesis strategies of KV event streams over a fleet, with consistent block chains
(a block's hash is a function of its whole prefix, as vLLM's are) and some bad input."""

from __future__ import annotations

import hashlib

from hypothesis import strategies as st

from kvblock.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

INSTANCES = ("e0", "e1", "e2")
MEDIA = ("GPU", "CPU", None)


def h64(path: tuple) -> int:
    """The 64-bit hash of a block whose prefix (tokens per block) is ``path``."""
    d = hashlib.blake2b(repr(path).encode(), digest_size=8).digest()
    return int.from_bytes(d, "big")


def chain_of(req: tuple) -> list[int]:
    return [h64(req[: i + 1]) for i in range(len(req))]


requests = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)


@st.composite
def event(draw):
    kind = draw(st.sampled_from(["stored"] * 6 + ["removed"] * 3 + ["cleared", "bad_parent", "other_group"]))
    medium = draw(st.sampled_from(MEDIA))
    if kind == "cleared":
        return AllBlocksCleared()
    req = draw(requests)
    hashes = chain_of(req)
    if kind == "removed":
        picks = draw(st.lists(st.integers(0, len(hashes) - 1), min_size=1, max_size=3))
        return BlockRemoved(block_hashes=[hashes[i] for i in picks], medium=medium)
    a = draw(st.integers(0, len(hashes) - 1))
    b = draw(st.integers(a + 1, len(hashes)))
    parent = hashes[a - 1] if a > 0 else None
    if kind == "bad_parent":
        parent = draw(st.sampled_from([None, h64(("x",)), hashes[0]]))
    # digests or ints: both reduce to the same event int
    as_bytes = draw(st.booleans())
    blocks = [h.to_bytes(32, "big") if as_bytes else h for h in hashes[a:b]]
    return BlockStored(block_hashes=blocks, parent_block_hash=parent, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None, group_idx=1 if kind == "other_group" else None)


@st.composite
def fleet_stream(draw, max_batches: int = 25):
    """``[(instance, payload bytes), ...]``: event batches of several instances."""
    n = draw(st.integers(1, max_batches))
    out = []
    for _ in range(n):
        inst = draw(st.sampled_from(INSTANCES))
        evs = draw(st.lists(event(), min_size=0, max_size=4))
        out.append((inst, encode_batch(evs, ts=0.0)))
    return out


queries = st.lists(requests, min_size=1, max_size=6)
