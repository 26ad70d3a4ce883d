"""Block hashes of replayed requests, memoised per trace hash id.

vLLM hashes a request's prompt with ``get_request_block_hasher`` when the request is created,
then every block its outputs complete. :class:`RequestHasher` produces the same digests
(``hash_i = H((hash_{i-1}, tokens_i, None))`` from ``NONE_HASH``) for replayed requests, with
two shortcuts that do not change a single digest:

* the digests are computed in one call per request (one Rust call for kvblock);
* for hash-id traces whose block size ``B`` is a multiple of the manager's block size
  ``b``, the ``B // b`` digests of a trace block depend only on the digest before it and on
  its id (its tokens are a function of the id). They are memoised under
  ``(parent digest, id)`` and reused by every later request with the same prefix, so each
  distinct trace block is hashed once per replay (or per sweep). Keying by the parent digest
  keeps the memo exact even for traces whose ids were not prefix hashes.

Only the calls into the hash function are timed (``hash_ns``); ``blocks_hashed`` counts the
digests computed and ``blocks_reused`` those taken from the memo.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .backends import Impl
from .expand import DEFAULT_CACHE_TOKENS, HashIdExpander, synthetic_output_tokens
from .trace import TraceRequest

__all__ = ["RequestHasher"]


class RequestHasher:
    """Computes ``block_hashes`` of :class:`TraceRequest` prompts and outputs for one
    implementation, hash algorithm and block size.

    Args:
        impl: the implementation whose hash function and root (``impl.root(hash_algo)``,
            the root its managers of ``hash_algo`` chain from) are used.
        block_size: the manager's block size (tokens).
        hash_algo: vLLM hash algorithm name.
        trace_block_size: tokens per hash id for hash-id traces (None otherwise).

    Call :meth:`start_run` after creating a manager (it reads the root; the memo is dropped
    if the root changed since the last run).
    """

    def __init__(self, impl: Impl, block_size: int, hash_algo: str, trace_block_size: int | None) -> None:
        self.impl = impl
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.trace_block_size = trace_block_size
        self.memoised = bool(trace_block_size) and trace_block_size % block_size == 0
        # With the digest memo each trace block is expanded once: caching its tokens is useless.
        self.expander = (
            HashIdExpander(trace_block_size, cache_tokens=0 if self.memoised else DEFAULT_CACHE_TOKENS)
            if trace_block_size
            else None
        )
        self.sub_blocks = trace_block_size // block_size if self.memoised else 0
        self._memo: dict[tuple[bytes, int], list] = {}
        self._root: bytes | None = None
        self.hash_ns = 0
        self.blocks_hashed = 0
        self.blocks_reused = 0

    def start_run(self) -> None:
        """Bind to the implementation's current root hash and reset the counters."""
        root = self.impl.root(self.hash_algo)
        if root != self._root:
            self._memo.clear()
            self._root = root
        self.hash_ns = self.blocks_hashed = self.blocks_reused = 0

    # -- hashing ------------------------------------------------------------------------------
    def chain(self, parent: bytes | None, tokens: np.ndarray) -> list:
        """Digests of every full block of ``tokens`` chained from ``parent`` (None: the root).
        Timed and counted."""
        toks: Any = tokens.tolist() if self.impl.token_lists else np.ascontiguousarray(tokens)
        t0 = time.perf_counter_ns()
        out = self.impl.hash_chain(toks, self.block_size, self.hash_algo, parent or self._root)
        self.hash_ns += time.perf_counter_ns() - t0
        self.blocks_hashed += len(out)
        return out

    def prompt_tokens(self, req: TraceRequest) -> np.ndarray:
        """The request's prompt token ids (expanded from its hash ids if needed)."""
        if req.prompt_tokens is not None:
            return req.prompt_tokens
        assert self.expander is not None and req.hash_ids is not None
        return self.expander.prompt_tokens(req.hash_ids, req.prompt_len)

    def prompt_hashes(self, req: TraceRequest) -> list:
        """``block_hashes`` of the prompt: one digest per full ``block_size`` block."""
        if not self.memoised or req.hash_ids is None:
            num_full = req.prompt_len // self.block_size
            return self.chain(None, self.prompt_tokens(req)[: num_full * self.block_size])
        return self._memo_prompt_hashes(req)

    def _memo_prompt_hashes(self, req: TraceRequest) -> list:
        k = self.sub_blocks
        num_full = req.prompt_len // self.block_size
        if num_full == 0:
            return []
        memo = self._memo
        ids = req.hash_ids
        id_list = ids.tolist()
        out: list = []
        parent = self._root
        i = 0
        for i, h in enumerate(id_list):
            digests = memo.get((parent, h))
            if digests is None:
                break
            need = num_full - len(out)
            if need <= k:
                out.extend(digests[:need])
                self.blocks_reused += need
                return out
            out.extend(digests)
            parent = digests[-1]
        else:
            self.blocks_reused += len(out)
            return out
        self.blocks_reused += len(out)
        # Hash the full expansion of every remaining trace block in one call and memoise it
        # (a partial last block is expanded fully: its sub-block digests are prefixes).
        rest = ids[i:]
        toks = self.expander.block_tokens(rest).reshape(-1)
        digests = self.chain(parent, toks)
        for j, h in enumerate(id_list[i:]):
            chunk = digests[j * k : (j + 1) * k]
            memo[(parent, h)] = chunk
            parent = chunk[-1]
        out.extend(digests[: num_full - len(out)])
        return out

    def tail_tokens(self, req: TraceRequest) -> np.ndarray:
        """Tokens after the prompt's last full block, followed by all the request's outputs
        (its ``output_tokens``, or unique synthetic ones)."""
        start = (req.prompt_len // self.block_size) * self.block_size
        if req.prompt_tokens is not None:
            head = req.prompt_tokens[start:]
        else:
            first = start // self.trace_block_size
            head = self.expander.prompt_tokens(req.hash_ids[first:], req.prompt_len - first * self.trace_block_size)
            head = head[start - first * self.trace_block_size :]
        if req.output_tokens is not None:
            outputs = req.output_tokens[: req.output_len]
        else:
            outputs = synthetic_output_tokens(req.index, req.output_len)
        return np.concatenate([head, outputs])

    @property
    def memo_entries(self) -> int:
        """Trace blocks in the memo."""
        return len(self._memo)
