""":class:`DictIndex`: the fleet prefix index in plain Python dicts of sets.

The same semantics as :class:`kvblock.cluster.PrefixIndex` (see its docstring), written for
reading: ``blocks[medium][hash][parent_tag]`` is the set of instances holding ``hash`` under
that parent. It is the reference of the lockstep tests and the baseline of the benchmarks.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, decode_batch
from .index import parent_tag

__all__ = ["DictIndex", "as_event_int"]

_M64 = (1 << 64) - 1


def as_event_int(h: Any) -> int:
    """A block hash as vLLM's 64-bit event int (digests: last 8 bytes, big-endian)."""
    if isinstance(h, (bytes, bytearray)):
        if not h:
            raise ValueError("an empty block-hash digest")
        return int.from_bytes(h, "big") & _M64
    if isinstance(h, bool) or not isinstance(h, int):
        raise TypeError(f"a block hash must be an int or bytes, got {type(h).__name__}")
    if not 0 <= h <= _M64:
        raise ValueError("a block hash int must be in [0, 2**64)")
    return h


class DictIndex:
    """Block hash -> holders in dicts of sets (see the module docstring).

    Args:
        block_size: skip ``BlockStored`` events of other block sizes (None: any).
        group_idx: the KV-cache group indexed (None in an event is group 0).
    """

    def __init__(self, block_size: int | None = None, group_idx: int = 0) -> None:
        self.block_size = block_size
        self.group_idx = group_idx
        self.blocks: dict[str | None, dict[int, dict[int, set[str]]]] = {}
        self._instances: dict[str, None] = {}

    # -- instances ----------------------------------------------------------------------------
    def add_instance(self, name: str) -> None:
        """Register instance ``name`` (a no-op if it is registered)."""
        self._instances.setdefault(name, None)

    def instances(self) -> list[str]:
        """The registered instance names, in registration order."""
        return list(self._instances)

    def clear_instance(self, name: str) -> int:
        """Drop every block ``name`` holds, keeping it registered; returns the (block, instance)
        pairs removed. Raises ``KeyError`` for an unknown instance.
        """
        if name not in self._instances:
            raise KeyError(f"unknown instance {name!r}")
        removed = 0
        for table in self.blocks.values():
            for h in list(table):
                node = table[h]
                for tag in list(node):
                    s = node[tag]
                    if name in s:
                        s.discard(name)
                        removed += 1
                        if not s:
                            del node[tag]
                if not node:
                    del table[h]
        return removed

    def remove_instance(self, name: str) -> int:
        """Forget instance ``name`` and its blocks; returns the (block, instance) pairs removed.
        Raises ``KeyError`` for an unknown instance.
        """
        removed = self.clear_instance(name)
        del self._instances[name]
        return removed

    # -- events -------------------------------------------------------------------------------
    def apply(self, name: str, payload: bytes, now_ms: int = 0) -> tuple[int, int, int, int]:
        """Decode (msgspec) and apply one ``KVEventBatch``; ``(stored, removed, cleared,
        skipped)``. A malformed payload raises ``ValueError`` before anything changes."""
        import msgspec

        try:
            batch = decode_batch(payload)
            events = batch.events
            for ev in events:  # validate every hash before changing anything
                for h in getattr(ev, "block_hashes", ()):
                    as_event_int(h)
                p = getattr(ev, "parent_block_hash", None)
                if p is not None:
                    as_event_int(p)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as e:
            raise ValueError(f"malformed KV event batch: {e}") from None
        return self.apply_events(name, events)

    def apply_events(self, name: str, events: Sequence[KVCacheEvent], now_ms: int = 0) -> tuple[int, int, int, int]:
        """Apply ``kvblock.events`` / vLLM event structs from instance ``name`` (registered if
        new); ``(stored, removed, cleared, skipped)`` as :meth:`apply`. ``now_ms`` is accepted
        for ``PrefixIndex``'s signature and not used (no expiry here).
        """
        self.add_instance(name)
        stored = removed = cleared = skipped = 0
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                removed += self.clear_instance(name)
                cleared += 1
            elif isinstance(ev, BlockStored):
                group = ev.group_idx or 0
                if group != self.group_idx or (self.block_size is not None and ev.block_size != self.block_size):
                    skipped += 1
                    continue
                d_add, d_drop = self._store(name, ev.block_hashes, ev.parent_block_hash, ev.medium)
                stored += d_add
                removed += d_drop
            elif isinstance(ev, BlockRemoved):
                if (ev.group_idx or 0) != self.group_idx:
                    skipped += 1
                    continue
                removed += self._remove(name, ev.block_hashes, ev.medium)
        return stored, removed, cleared, skipped

    def _store(self, name: str, hashes: Sequence[Any], parent: Any, medium: str | None) -> tuple[int, int]:
        table = self.blocks.setdefault(medium, {})
        tag = parent_tag(None if parent is None else as_event_int(parent))
        added = dropped = 0
        for raw in hashes:
            h = as_event_int(raw)
            node = table.setdefault(h, {})
            for t in list(node):
                if t != tag and name in node[t]:
                    node[t].discard(name)
                    dropped += 1
                    if not node[t]:
                        del node[t]
            s = node.setdefault(tag, set())
            if name not in s:
                s.add(name)
                added += 1
            tag = parent_tag(h)
        # vLLM-style net accounting, as the Rust index reports it
        net = added - dropped
        return (net, 0) if net >= 0 else (0, -net)

    def _remove(self, name: str, hashes: Sequence[Any], medium: str | None) -> int:
        table = self.blocks.get(medium)
        if table is None:
            return 0
        removed = 0
        for raw in hashes:
            h = as_event_int(raw)
            node = table.get(h)
            if node is None:
                continue
            for t in list(node):
                if name in node[t]:
                    node[t].discard(name)
                    removed += 1
                    if not node[t]:
                        del node[t]
            if not node:
                del table[h]
        return removed

    def store(self, name: str, block_hashes: Sequence[Any], parent_block_hash: Any = None, medium: str | None = "GPU") -> int:
        """Instance ``name`` (registered if new) holds ``block_hashes`` (a chain) on ``medium``,
        the first under ``parent_block_hash``; returns the pairs added (net). Hashes: ``int``
        in [0, 2**64) or digest ``bytes`` (``TypeError`` / ``ValueError`` otherwise).
        """
        self.add_instance(name)
        return self._store(name, block_hashes, parent_block_hash, medium)[0]

    def remove(self, name: str, block_hashes: Sequence[Any], medium: str | None = "GPU") -> int:
        """Instance ``name`` no longer holds ``block_hashes`` on ``medium``; returns the pairs
        removed. Hash errors as :meth:`store`.
        """
        self.add_instance(name)
        return self._remove(name, block_hashes, medium)

    # -- lookups ------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[Any], medium: str | None = None) -> dict[str, int]:
        """Longest cached prefix (blocks) per instance with a hit (``medium`` None: any)."""
        tables = list(self.blocks.values()) if medium is None else [self.blocks.get(medium, {})]
        return self._match_tables(block_hashes, tables)

    def match_weighted(self, block_hashes: Sequence[Any], weights: dict[str | None, float]) -> dict[str, tuple[float, int]]:
        """Tier-weighted prefixes, ``{name: (credit, blocks)}``, as ``PrefixIndex.match_weighted``."""
        for m, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise ValueError(f"weights: the weight of medium {m!r} must be a finite number >= 0, got {w!r}")
        tiers = sorted({float(weights.get(m, 0)) for m in self.blocks} - {0.0}, reverse=True)
        out: dict[str, tuple[float, int]] = {}
        prev: dict[str, int] = {}
        for t in tiers:
            cur = self._match_tables(block_hashes, [tb for m, tb in self.blocks.items() if weights.get(m, 0) >= t])
            for name, k in cur.items():
                out[name] = (out.get(name, (0.0, 0))[0] + t * (k - prev.get(name, 0)), k)
            prev = cur
        return out

    def _match_tables(self, block_hashes: Sequence[Any], tables: list[dict[int, dict[int, set[str]]]]) -> dict[str, int]:
        out: dict[str, int] = {}
        alive: set[str] | None = None
        tag = 0
        i = 0
        for i, raw in enumerate(block_hashes):
            h = as_event_int(raw)
            cur: set[str] = set()
            for table in tables:
                node = table.get(h)
                if node is not None:
                    cur |= node.get(tag, set())
            if alive is None:
                alive = cur
            else:
                for name in alive - cur:
                    out[name] = i
                alive = alive & cur
            if not alive:
                return out
            tag = parent_tag(h)
        for name in alive or ():
            out[name] = i + 1
        return out

    def num_pairs(self) -> int:
        """The (block, holder) pairs held (a block held on two media counts twice)."""
        return sum(len(s) for table in self.blocks.values() for node in table.values() for s in node.values())

    def num_nodes(self) -> int:
        """The distinct (medium, block, parent) nodes held."""
        return sum(len(node) for table in self.blocks.values() for node in table.values())
