"""The CASES.md shorthands (lookup, admit, decode, free, preempt, queue, ...) over one manager.

A :class:`Harness` wraps a ``KVCacheManager`` of any implementation in ``tests/impls.py`` and
spells the call sequences of ``../shared/cases/CASES.md`` ("Conventions") as methods, so a
test reads like its case.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvblock.request import Request, RequestStatus


def ids(blocks: Any) -> list[int]:
    """Block ids of group 0 of a ``KVCacheBlocks``."""
    return blocks.get_block_ids()[0]


class Harness:
    """One manager plus the CASES.md shorthands.

    Args:
        impl: an entry of ``tests/impls.py``.
        num_blocks, block_size: the pool (``N``) and block size (``BS``).
        **kwargs: further ``KVCacheManager`` keywords; ``log_stats`` defaults to True and
            ``max_model_len`` to 4096, as CASES.md assumes.
    """

    def __init__(self, impl: Any, num_blocks: int, block_size: int, **kwargs: Any) -> None:
        kwargs.setdefault("log_stats", True)
        kwargs.setdefault("max_model_len", 4096)
        self.impl = impl
        self.block_size = block_size
        self.mgr = impl.KVCacheManager(num_blocks, block_size, **kwargs)
        self.pool = self.mgr.block_pool
        self._ids = itertools.count()

    # -- requests --------------------------------------------------------------------------
    def req(self, tokens: list[int], request_id: str | None = None, **kwargs: Any) -> Request:
        """A request hashed with the manager's block hasher (``Request`` keywords pass on)."""
        if request_id is None:
            request_id = f"r{next(self._ids)}"
        return Request(request_id, tokens, block_hasher=self.mgr.request_block_hasher, **kwargs)

    def lookup(self, r: Request) -> tuple[list[int], int, Any]:
        """``get_computed_blocks``: (hit block ids, hit tokens, the KVCacheBlocks)."""
        blocks, n, _ = self.mgr.get_computed_blocks(r)
        return ids(blocks), n, blocks

    def admit(self, r: Request) -> tuple[list[int], list[int]]:
        """lookup + allocate_slots + record stats; the request then runs with every prompt
        token computed. Returns (hit ids, new ids)."""
        hit, n, blocks = self.lookup(r)
        new = self.mgr.allocate_slots(r, r.num_tokens - n, n, blocks)
        assert new is not None, f"admission of {r.request_id} failed"
        self.mgr.record_prefix_cache_stats(r, n)
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        return hit, ids(new)

    def sample(self, r: Request, token: int) -> None:
        """Append the token produced by the step just run."""
        r.append_output_token_ids(token)

    def decode(self, r: Request, token: int) -> list[int]:
        """One decode step: allocate a slot, compute it, append ``token``. Returns new ids."""
        new = self.mgr.allocate_slots(r, 1)
        assert new is not None, f"decode of {r.request_id} failed"
        r.num_computed_tokens += 1
        r.append_output_token_ids(token)
        return ids(new)

    def free(self, r: Request) -> None:
        """``mgr.free(r)``."""
        self.mgr.free(r)

    def preempt(self, r: Request) -> None:
        """Free the request and reset it as vLLM's scheduler does on preemption."""
        self.mgr.free(r)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        r.status = RequestStatus.PREEMPTED

    # -- observations ------------------------------------------------------------------------
    def queue(self) -> list[int]:
        """Free-queue block ids, head (next to evict) first."""
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def free_count(self) -> int:
        """Free blocks, cached ones included."""
        return self.pool.get_num_free_blocks()

    def map_size(self) -> int:
        """Keys in the hash -> block map."""
        return len(self.pool.cached_block_hash_to_block)

    def table(self, r: Request) -> list[int]:
        """The request's block ids (group 0)."""
        return self.mgr.get_block_ids(r.request_id)[0]

    def block(self, block_id: int) -> Any:
        """The pool's block ``block_id``."""
        return self.pool.blocks[block_id]
