"""Deterministic token ids for hash-id traces (vectorised, cached per hash id).

A trace block id ``h`` of a trace with ``B``-token blocks stands for the ``B`` tokens
``OFFSET + splitmix64(h * B + j) % VOCAB``, ``j = 0 … B-1`` (``VOCAB = 32000``,
``OFFSET = 1000``), exactly the rule of the shared traces' README for ``B = 512``. A prompt
is the concatenation of its ids' blocks cut to ``input_length``. Equal ids give equal
blocks; different ids collide with negligible probability.

Synthetic output tokens (traces carry no output ids) come from a separate domain of the same
generator, unique per request, so they never match a prompt block by accident.
"""

from __future__ import annotations

import numpy as np

from collections import OrderedDict

from .peer_workload import splitmix64

__all__ = ["OFFSET", "VOCAB", "HashIdExpander", "expand_block_tokens", "synthetic_output_tokens"]

#: Vocabulary size and offset of the synthetic token ids (ids ``1000 … 32999``).
VOCAB = 32000
OFFSET = 1000
#: Tokens kept in :class:`HashIdExpander`'s cache by default (64 MiB of int64).
DEFAULT_CACHE_TOKENS = 8 << 20
_OUTPUT_DOMAIN = np.uint64(1 << 63)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64_inplace(x: np.ndarray) -> np.ndarray:
    """``splitmix64`` of a ``uint64`` array, computed in place (``x`` is overwritten)."""
    x += _GOLDEN
    t = x >> np.uint64(30)
    x ^= t
    x *= _MIX1
    np.right_shift(x, np.uint64(27), out=t)
    x ^= t
    x *= _MIX2
    np.right_shift(x, np.uint64(31), out=t)
    x ^= t
    return x


def expand_block_tokens(ids: np.ndarray, trace_block_size: int) -> np.ndarray:
    """The tokens of trace blocks ``ids``: an int64 array of shape ``(len(ids), B)``.

    Row ``i`` holds ``OFFSET + splitmix64(ids[i] * B + j) % VOCAB`` for ``j < B``
    (arithmetic modulo 2**64). One vectorised numpy computation, no Python loop.
    """
    b = np.uint64(trace_block_size)
    x = np.asarray(ids, dtype=np.int64).astype(np.uint64)[:, None] * b + np.arange(
        trace_block_size, dtype=np.uint64
    )
    _splitmix64_inplace(x)
    x %= np.uint64(VOCAB)
    out = x.view(np.int64)
    out += OFFSET
    return out


def synthetic_output_tokens(index: int, n: int) -> np.ndarray:
    """``n`` output token ids for request ``index`` of a trace without output ids.

    ``OFFSET + splitmix64(2**63 | index << 24 | j) % VOCAB``: disjoint from every prompt
    block's inputs ``h * B + j < 2**63``, and unique per request.
    """
    j = np.arange(n, dtype=np.uint64)
    x = _OUTPUT_DOMAIN | (np.uint64(index) << np.uint64(24)) | j
    return (splitmix64(x) % np.uint64(VOCAB)).astype(np.int64) + OFFSET


class HashIdExpander:
    """Expand trace block ids to token ids, caching each id's block.

    Args:
        trace_block_size: tokens per hash id (512 for Mooncake, 16 for Bailian).
        cache_tokens: how many tokens the cache keeps (least recently used ids are dropped
            first); 0 disables the cache.

    The ids missing from the cache are expanded together in one numpy call.
    """

    def __init__(self, trace_block_size: int, cache_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        if trace_block_size <= 0:
            raise ValueError(f"trace_block_size must be > 0, got {trace_block_size}")
        self.trace_block_size = trace_block_size
        self._max_ids = cache_tokens // trace_block_size
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def block_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Tokens of the given ids, shape ``(len(ids), trace_block_size)``, int64."""
        ids = np.asarray(ids, dtype=np.int64)
        if self._max_ids == 0:
            return expand_block_tokens(ids, self.trace_block_size)
        cache = self._cache
        keys = ids.tolist()
        missing = [h for h in dict.fromkeys(keys) if h not in cache]
        fresh: dict[int, np.ndarray] = {}
        if missing:
            rows = expand_block_tokens(np.array(missing, dtype=np.int64), self.trace_block_size)
            fresh = dict(zip(missing, rows))
        out = np.empty((len(keys), self.trace_block_size), dtype=np.int64)
        for i, h in enumerate(keys):
            row = fresh.get(h)
            if row is None:
                row = cache[h]
                cache.move_to_end(h)
            out[i] = row
        for h, row in fresh.items():
            cache[h] = row
        while len(cache) > self._max_ids:
            cache.popitem(last=False)
        return out

    def prompt_tokens(self, hash_ids: np.ndarray, prompt_len: int) -> np.ndarray:
        """The prompt of a record: its blocks concatenated and cut to ``prompt_len``."""
        return self.block_tokens(hash_ids).reshape(-1)[:prompt_len]
