"""The in-process fleet prefix index: the Python face of the Rust ``PrefixIndexCore``."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from .. import _core
from ..events import KVCacheEvent, encode_batch

__all__ = ["PrefixIndex", "event_ints", "parent_tag"]

#: ``parent_tag(parent_block_hash=None) -> int``: the 32-bit tag the index keeps of a block's
#: parent (0 for a chain's first block). The Redis index stores the same tag.
parent_tag = _core.parent_tag
#: ``event_ints(block_hashes) -> uint64 array``: hashes as vLLM's 64-bit event ints.
event_ints = _core.event_ints


class PrefixIndex(_core.PrefixIndexCore):
    """Block hash -> instances holding it (per medium), fed by vLLM 0.33.0 KV event batches.

    A block hash is vLLM's 64-bit event int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the
    default) or a digest (``bytes``), which is reduced to the same int (its last 8 bytes,
    big-endian, as vLLM converts it), so engines publishing either form index alike and a
    router may look up the ``bytes`` hashes of ``kvblock.hashing`` directly.

    Semantics: an instance holds a hash, under the parent its ``BlockStored`` gave, until a
    ``BlockRemoved`` of it, an ``AllBlocksCleared``, a re-store under another parent or its
    removal. :meth:`match` walks a request's chain: instance ``i`` matches ``k`` blocks if it
    holds block ``j`` under parent ``j - 1`` (no parent for ``j = 0``) for every ``j < k``.
    Holder sets are sets (vLLM can cache two copies of a block; evicting one makes the index
    forget it: an under-report, never an over-report).

    Memory cap (``max_pairs``): at most that many (block, instance) pairs are kept (about
    16-30 bytes each, plus one byte a table slot for the chain depths a capped index keeps,
    :meth:`memory_bytes`). After a batch that goes over, whole blocks (all their holders) are
    evicted deepest first, down to 1/64 below the cap: a lookup walks a chain from its first
    block and stops at the first one missing, so the index cuts every chain at one depth
    ``D`` (all blocks deeper than ``D``, then blocks at ``D`` in clock order, media sharing
    them by their counts) and each chain keeps its head, which is what tells the router
    where the rest is. Blocks whose parent the index does not hold (unreachable) and blocks
    over 254 deep count as deepest; chains' first blocks go last (one instance's before
    shared). An evicted block is forgotten until its engine stores it again: the index
    under-reports it (and the rest of its chain), never over-reports. :meth:`evicted`
    counts what went.

    Tier weights (:meth:`match_weighted`): with each medium's weight (``{"GPU": 1.0, "CPU":
    0.75, "disk": 0.25}``), an instance's credit is its prefix on the best tier at that
    tier's weight, plus what the next tier extends it by at the next weight, and so on (a
    lower bound of each block's best weight).

    Args:
        block_size: tokens per block; events of other block sizes are skipped (None: any).
        group_idx: the KV-cache group indexed (events without ``group_idx`` are group 0).
        max_pairs: the memory cap in (block, instance) pairs (None: none); settable later
            (``index.max_pairs = N``; lowering it evicts at once).

    Methods (all from Rust; ``KeyError`` names an unknown instance where one must exist
    (``remove_instance``, ``clear_instance``, ``blocks_of``); an instance name UTF-8
    cannot encode, one with a lone surrogate, is a ``ValueError`` naming ``name``, nothing
    changed):
        ``apply(instance, payload, now_ms=0) -> (stored, removed, cleared, skipped)``: apply
            the msgpack bytes of one ``KVEventBatch`` (decoded in Rust). A malformed payload
            raises ``ValueError`` and changes nothing. The instance is registered if new.
        ``match(block_hashes, medium=None) -> dict[str, int]``: longest cached prefix, in
            blocks, of every instance with a hit (``medium`` None: a block on any medium).
        ``match_dense(block_hashes, medium=None) -> uint32 array``: the same by instance id
            (``instance_id(name)``), zeros included; the fast form.
        ``store`` / ``remove`` (one ``BlockStored`` / ``BlockRemoved``), ``add_instance``,
        ``remove_instance``, ``clear_instance`` (pairs removed), ``touch(instance, now_ms)``
            (a heartbeat: the instance is registered if new, as by ``apply``),
        ``expire(now_ms, ttl_ms) -> removed names``, ``instances()``, ``blocks_of``,
        ``num_pairs()`` ((block, holder) pairs), ``num_nodes()``, ``memory_bytes()`` (heap
        bytes of the tables, the holder sets and the instance registry).
        ``evicted() -> (pairs, nodes, sweeps)``: what the memory cap dropped so far.
        ``match_weighted(block_hashes, weights) -> dict[str, (credit, blocks)]``: tier-
            weighted prefixes (credit in blocks; ``blocks`` the prefix over every medium of
            positive weight); a weight that is not a finite number >= 0 is a ValueError.
    """

    def __init__(self, block_size: int | None = None, group_idx: int = 0, *, max_pairs: int | None = None) -> None:
        if max_pairs is not None:
            self.max_pairs = max_pairs

    def apply_events(self, instance: str, events: Sequence[KVCacheEvent], now_ms: int = 0) -> tuple[int, int, int, int]:
        """Apply ``kvblock.events`` / vLLM event structs (encoded to the wire format first)."""
        return self.apply(instance, encode_batch(list(events), ts=0.0), now_ms)

    def bytes_per_pair(self) -> float:
        """``memory_bytes() / num_pairs()`` (0.0 when empty)."""
        n = self.num_pairs()
        return self.memory_bytes() / n if n else 0.0

    def match_instances(self, block_hashes: Any, instances: Iterable[str], medium: str | None = None) -> dict[str, int]:
        """:meth:`match` restricted to ``instances`` (0 for those without a hit or unknown)."""
        hits = self.match(block_hashes, medium)
        return {name: hits.get(name, 0) for name in instances}

    def __repr__(self) -> str:
        return (f"PrefixIndex(instances={len(self.instances())}, pairs={self.num_pairs():,}, "
                f"nodes={self.num_nodes():,}, bytes={self.memory_bytes():,})")
