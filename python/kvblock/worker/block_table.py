"""Per-request block tables and slot mapping on torch tensors (spec §9, vLLM 0.33.0's
``vllm.v1.worker.block_table``).

The worker keeps, for every running request, the ids of the KV-cache blocks the manager gave
it (one *row* of an int32 table ``[max_num_reqs, max_num_blocks_per_req]``), and turns each
scheduled token ``(request row r, position p)`` into a *slot*: the token's index in the
flattened KV cache ``[num_blocks * block_size, ...]``::

    slot = block_table[r, p // block_size] * block_size + p % block_size

Attention kernels write K/V at these slots and read K/V through the block table.

What kvblock mirrors and where it deliberately differs from vLLM 0.33.0:

* The table lives twice, as in vLLM's ``CpuGpuBuffer``: a host mirror that row operations
  edit (pinned on CUDA when ``pin_memory``) and a device tensor that
  :meth:`BlockTable.commit_block_table` refreshes with an asynchronous host-to-device copy.
  The per-row block counts are committed along with the rows.
* vLLM's slot-mapping kernel does not check that ``p // block_size`` is inside the row and
  reads the *next row's* block instead (spec §13.4, CASES.md C22). kvblock never reads past a
  row: such a position raises ``ValueError`` (default) or, with ``check=False``, gets
  :data:`PAD_SLOT_ID`.
* Slot mapping is computed from committed state only; computing it while rows changed since
  the last commit raises (vLLM silently uses the stale device table).
* Entries past a row's count are kept zero (vLLM leaves stale ids behind after ``add_row`` of
  a shorter row); ``move_row`` zeroes the source as spec §9 says.

Slot mapping is vectorized, with no Python loop per token: on CPU numpy over the tensors'
memory (zero-copy; the same operations as the torch path at a fraction of torch's
per-operation overhead), on CUDA a Triton kernel when ``triton`` imports, else fused torch
ops on the device. All paths give identical results (``impl=`` picks one explicitly).
:func:`slot_mapping_reference` is the straightforward per-token Python definition the tests
and benchmarks compare against.

Kernel block sizes (spec §9, ``AttentionGroup.map_to_kernel_block_table``): when the
attention kernel wants blocks of ``kernel_block_size < block_size`` tokens, every manager
block ``b`` becomes ``m = block_size // kernel_block_size`` kernel blocks ``b * s + j``
(``j = 0..m-1``; the stride ``s`` is ``m`` unless a packed cache places other pages between
blocks). Slot mappings stay in manager-block units; :meth:`BlockTable.kernel_block_table`
gives the expanded table for the kernel.

This module needs torch (the ``torch`` extra); ``import kvblock`` does not import it.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Sequence

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without the torch extra
    from .._optional import install_hint

    raise ImportError(f"kvblock.worker.block_table needs torch: {install_hint('torch', 'torch')}") from e

__all__ = [
    "INT32_MAX",
    "PAD_SLOT_ID",
    "BlockTable",
    "MultiGroupBlockTable",
    "get_block_table_width",
    "map_to_kernel_blocks",
    "reshape_and_cache",
    "slot_mapping_reference",
    "triton_available",
]

#: The slot of a padding token (vLLM's ``PAD_SLOT_ID``): attention writes nothing there.
PAD_SLOT_ID = -1
#: The largest block id an int32 block table holds.
INT32_MAX = 2**31 - 1
#: Tokens per Triton program iteration (vLLM's ``BLOCK_SIZE=1024`` tile).
_TILE = 1024

_IMPLS = ("auto", "numpy", "torch", "triton")


# -- helpers ------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: must be positive, got {value}")
    return int(value)


def _normalize_device(device: Any) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _same_device(t: torch.Tensor, dev: torch.device) -> bool:
    d = t.device
    if d.type != dev.type:
        return False
    return dev.index is None or d.index is None or d.index == dev.index


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True if ``triton`` imports (the CUDA slot-mapping kernel can be used); cached."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def get_block_table_width(num_blocks: int, block_size: int, token_alignment: int = 128) -> int:
    """Block-table width for rows of ``num_blocks`` blocks (vLLM 0.33.0
    ``get_block_table_width``): ``num_blocks`` rounded up to a multiple of
    ``token_alignment / gcd(token_alignment, block_size)`` blocks, so that every row spans a
    multiple of ``token_alignment`` tokens (some attention backends, e.g. TRT-LLM, need it).

    Raises:
        ValueError: a non-positive ``block_size`` or ``token_alignment``, or a negative
            ``num_blocks``.
    """
    block_size = _positive_int("block_size", block_size)
    token_alignment = _positive_int("token_alignment", token_alignment)
    if num_blocks < 0:
        raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
    align = token_alignment // math.gcd(token_alignment, block_size)
    return _cdiv(num_blocks, align) * align


def _kernel_split(block_size: int, kernel_block_size: int | None, kernel_block_stride: int | None) -> tuple[int, int, int]:
    """Validate the kernel-block arguments; return ``(kernel_block_size, m, stride)``."""
    if kernel_block_size is None:
        kernel_block_size = block_size
    kernel_block_size = _positive_int("kernel_block_size", kernel_block_size)
    if block_size % kernel_block_size != 0:
        raise ValueError(
            f"kernel_block_size: {kernel_block_size} does not divide block_size {block_size}"
        )
    m = block_size // kernel_block_size
    if kernel_block_stride is None:
        stride = m
    else:
        stride = _positive_int("kernel_block_stride", kernel_block_stride)
        if stride < m:
            raise ValueError(
                f"kernel_block_stride: {stride} is less than the {m} kernel blocks per block "
                "(kernel blocks of different manager blocks would overlap)"
            )
    return kernel_block_size, m, stride


def _max_block_id(m: int, stride: int) -> int:
    """Largest manager block id whose kernel blocks ``b * stride + m - 1`` fit in int32."""
    return (INT32_MAX - (m - 1)) // stride


def _as_block_id_array(block_ids: Any, name: str, max_id: int = INT32_MAX) -> np.ndarray:
    """``block_ids`` (list / tuple / numpy / torch / array.array of ints) as int64 numpy,
    checked to lie in ``[0, max_id]``."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
            raise TypeError(f"{name}: block ids must be integers, got a {block_ids.dtype} tensor")
        if block_ids.dim() != 1:
            raise ValueError(f"{name}: must be 1-D, got shape {tuple(block_ids.shape)}")
        arr = block_ids.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(block_ids)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"{name}: must be 1-D, got shape {arr.shape}")
        if arr.dtype == object:
            # Python ints beyond int64: report the first one that does not fit.
            for i, v in enumerate(arr.tolist()):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"{name}: block ids must be integers, got {type(v).__name__} at index {i}")
                if not 0 <= v <= max_id:
                    raise _bad_block_id(name, int(v), i, max_id)
            arr = np.array([int(v) for v in arr.tolist()], dtype=np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name}: block ids must be integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8:
            big = arr > np.uint64(max_id)
            if big.any():
                i = int(np.argmax(big))
                raise _bad_block_id(name, int(arr[i]), i, max_id)
        arr = arr.astype(np.int64, copy=False)
    bad = (arr < 0) | (arr > max_id)
    if bad.any():
        i = int(np.argmax(bad))
        raise _bad_block_id(name, int(arr[i]), i, max_id)
    return arr


def _bad_block_id(name: str, v: int, i: int, max_id: int) -> ValueError:
    """The error for block id ``v`` at index ``i``: negative, or past ``max_id``."""
    if v < 0:
        return ValueError(f"{name}: block id {v} at index {i} is negative (block ids are >= 0)")
    hint = "" if max_id == INT32_MAX else " after kernel-block expansion"
    return ValueError(
        f"{name}: block id {v} at index {i} is not int32-representable{hint} (must lie in [0, {max_id}])"
    )


def map_to_kernel_blocks(
    block_ids: Any,
    block_size: int,
    kernel_block_size: int,
    kernel_block_stride: int | None = None,
) -> Any:
    """Expand manager block ids into kernel block ids (vLLM's
    ``AttentionGroup.map_to_kernel_block_table`` / ``BlockTable.map_to_kernel_blocks``).

    Each block ``b`` becomes ``m = block_size // kernel_block_size`` kernel blocks
    ``b * s + j`` for ``j = 0..m-1`` (``s = kernel_block_stride``, default ``m``), in order.
    Example: ``[0, 1, 2]`` with 32-token blocks and 16-token kernel blocks →
    ``[0, 1, 2, 3, 4, 5]``.

    Args:
        block_ids: a 1-D sequence of ints, a numpy array or a torch tensor (any integer
            dtype; a 2-D tensor ``[rows, width]`` expands each row to ``[rows, width * m]``).
        block_size: manager block size (tokens).
        kernel_block_size: the attention kernel's block size (tokens); must divide
            ``block_size``.
        kernel_block_stride: kernel blocks between consecutive manager blocks (>= ``m``).

    Returns:
        The same kind as the input: ``list[int]`` for a sequence, int64 numpy for numpy,
        a tensor of the input dtype and device for a tensor.

    Raises:
        ValueError: ``kernel_block_size`` does not divide ``block_size``; a stride below
            ``m``; a block id outside ``[0, 2**31-1]`` or whose kernel ids leave int32
            (sequences and numpy).
        TypeError: non-integer ids.
    """
    block_size = _positive_int("block_size", block_size)
    _, m, s = _kernel_split(block_size, kernel_block_size, kernel_block_stride)
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise TypeError(f"block_ids: block ids must be integers, got a {block_ids.dtype} tensor")
        if block_ids.dim() == 0:
            raise ValueError("block_ids: must be 1-D or 2-D, got a 0-d tensor")
        ar = torch.arange(m, device=block_ids.device, dtype=block_ids.dtype)
        out = block_ids.unsqueeze(-1) * s + ar
        return out.reshape(*block_ids.shape[:-1], block_ids.shape[-1] * m)
    arr = _as_block_id_array(block_ids, "block_ids", _max_block_id(m, s))
    out = (arr.reshape(-1, 1) * s + np.arange(m, dtype=np.int64)).reshape(-1)
    return out if isinstance(block_ids, np.ndarray) else out.tolist()


def slot_mapping_reference(
    rows: Sequence[Sequence[int]],
    block_size: int,
    query_start_loc: Sequence[int],
    positions: Sequence[int],
    max_num_batched_tokens: int,
    *,
    check: bool = True,
) -> list[int]:
    """Slot mapping, one token at a time in plain Python: the definition the vectorized
    paths are tested and benchmarked against.

    Args:
        rows: ``rows[r]`` is request ``r``'s block ids (only the blocks it holds).
        block_size: tokens per block.
        query_start_loc: ``num_reqs + 1`` token offsets; request ``r`` owns tokens
            ``query_start_loc[r] <= t < query_start_loc[r + 1]``.
        positions: the position of every scheduled token.
        max_num_batched_tokens: length of the result (padded with :data:`PAD_SLOT_ID`).
        check: raise on a position outside its row; if False such a token gets
            :data:`PAD_SLOT_ID`.

    Returns:
        ``list[int]`` of ``max_num_batched_tokens`` slots.

    Raises:
        ValueError: more tokens than ``max_num_batched_tokens``; with ``check``, a negative
            position or one at or past ``len(rows[r]) * block_size``.
    """
    out: list[int] = []
    for r in range(len(query_start_loc) - 1):
        row = rows[r]
        n = len(row)
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            p = positions[t]
            b = p // block_size
            if p < 0 or b >= n:
                if check:
                    raise ValueError(
                        f"positions: token {t} of row {r} is at position {p}, outside the "
                        f"{n} blocks the row holds"
                    )
                out.append(PAD_SLOT_ID)
            else:
                out.append(row[b] * block_size + p % block_size)
    if len(out) > max_num_batched_tokens:
        raise ValueError(
            f"positions: {len(out)} tokens exceed max_num_batched_tokens={max_num_batched_tokens}"
        )
    out.extend([PAD_SLOT_ID] * (max_num_batched_tokens - len(out)))
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V at its slot, skipping padding (vLLM's
    ``reshape_and_cache_flash`` op, in torch).

    Token ``i`` goes to ``cache.view(-1, ...)[slot_mapping[i]]``, i.e. block
    ``slot // block_size``, offset ``slot % block_size``. A :data:`PAD_SLOT_ID` slot writes
    nothing: it never becomes the cache's last slot through negative indexing (CASES.md C22
    call 4).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``
            (contiguous), same dtype and device as ``key``.
        slot_mapping: int64 ``[>= num_tokens]`` (the first ``num_tokens`` entries are used).

    Raises:
        ValueError: mismatched shapes, dtypes or devices; a slot below -1 or at or past
            ``num_blocks * block_size`` (named ``slot_mapping``).
    """
    n = key.shape[0]
    if value.shape != key.shape:
        raise ValueError(f"value: shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4 or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key_cache/value_cache: need [num_blocks, block_size, {', '.join(map(str, key.shape[1:]))}], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or slot_mapping.numel() < n:
        raise ValueError(
            f"slot_mapping: need int64 [>= {n}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name}: on {t.device}, key is on {key.device}")
        if name != "slot_mapping" and t.dtype != key.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from key's {key.dtype}")
    slots = slot_mapping[:n]
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    lo, hi = (int(x) for x in torch.stack([slots.min(), slots.max()]).tolist()) if n else (0, 0)
    if lo < PAD_SLOT_ID or hi >= num_slots:
        raise ValueError(f"slot_mapping: slots must lie in [-1, {num_slots}), got [{lo}, {hi}]")
    k_flat = key_cache.view(num_slots, *key_cache.shape[2:])
    v_flat = value_cache.view(num_slots, *value_cache.shape[2:])
    if lo >= 0:
        k_flat.index_copy_(0, slots, key)
        v_flat.index_copy_(0, slots, value)
        return
    keep = torch.nonzero(slots >= 0).squeeze(1)
    k_flat.index_copy_(0, slots[keep], key[keep])
    v_flat.index_copy_(0, slots[keep], value[keep])


# -- the Triton kernel (built on first use) -------------------------------------------------------
_TRITON_KERNEL: Any = None


def _triton_kernel() -> Any:
    """The Triton slot-mapping kernel, compiled lazily (``triton`` is imported here only)."""
    global _TRITON_KERNEL
    if _TRITON_KERNEL is not None:
        return _TRITON_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _slot_mapping_kernel(
        num_tokens,
        max_num_tokens,
        query_start_loc_ptr,  # [num_reqs + 1] int32
        positions_ptr,  # [num_tokens] int64
        block_table_ptr,  # [max_num_reqs, width] int32, row-major
        block_table_stride,  # width
        num_blocks_ptr,  # [max_num_reqs] int32: blocks each row holds (committed)
        block_size,
        slot_mapping_ptr,  # [max_num_tokens] int64
        error_ptr,  # [1] int32: tokens outside their row (accumulated)
        PAD_ID: tl.constexpr,
        TILE: tl.constexpr,
    ):
        # vLLM 0.33.0's _compute_slot_mapping_kernel plus two guards: a block index must be
        # inside the row's committed block count (else PAD_ID and an error count; vLLM reads
        # the next row), and token offsets are clamped to [0, num_tokens) so that a malformed
        # query_start_loc never reads or writes out of bounds.
        req_idx = tl.program_id(0)
        if req_idx == tl.num_programs(0) - 1:
            # Tokens before the first request or after the last one, and the CUDA-graph tail.
            first = tl.minimum(tl.maximum(tl.load(query_start_loc_ptr).to(tl.int64), 0), num_tokens)
            last = tl.minimum(tl.maximum(tl.load(query_start_loc_ptr + req_idx).to(tl.int64), 0), num_tokens)
            for i in range(0, first, TILE):
                offsets = i + tl.arange(0, TILE)
                tl.store(slot_mapping_ptr + offsets, PAD_ID, mask=offsets < first)
            for i in range(last, max_num_tokens, TILE):
                offsets = i + tl.arange(0, TILE)
                tl.store(slot_mapping_ptr + offsets, PAD_ID, mask=offsets < max_num_tokens)
            return
        start_idx = tl.maximum(tl.load(query_start_loc_ptr + req_idx).to(tl.int64), 0)
        end_idx = tl.minimum(tl.load(query_start_loc_ptr + req_idx + 1).to(tl.int64), num_tokens)
        row_blocks = tl.load(num_blocks_ptr + req_idx).to(tl.int64)
        row_offset = req_idx.to(tl.int64) * block_table_stride
        bad = tl.zeros((TILE,), dtype=tl.int32)
        for i in range(start_idx, end_idx, TILE):
            offsets = i + tl.arange(0, TILE)
            mask = offsets < end_idx
            pos = tl.load(positions_ptr + offsets, mask=mask, other=0)
            block_idx = pos // block_size
            ok = mask & (pos >= 0) & (block_idx < row_blocks)
            block_num = tl.load(block_table_ptr + row_offset + block_idx, mask=ok, other=0).to(tl.int64)
            slot = block_num * block_size + (pos - block_idx * block_size)
            slot = tl.where(ok, slot, PAD_ID)
            tl.store(slot_mapping_ptr + offsets, slot, mask=mask)
            bad += (mask & (ok == 0)).to(tl.int32)
        tl.atomic_add(error_ptr, tl.sum(bad, axis=0))

    _TRITON_KERNEL = _slot_mapping_kernel
    return _TRITON_KERNEL


# -- BlockTable -----------------------------------------------------------------------------------
class BlockTable:
    """One KV-cache group's block table: an int32 ``[max_num_reqs, max_num_blocks_per_req]``
    table on ``device``, its host mirror, the per-row block counts and the slot-mapping
    buffer (vLLM 0.33.0 ``vllm.v1.worker.block_table.BlockTable``, spec §9).

    Row operations (:meth:`add_row`, :meth:`append_row`, :meth:`clear_row`,
    :meth:`move_row`, :meth:`swap_row`) edit the host mirror and counts;
    :meth:`commit_block_table` copies the first ``num_reqs`` rows and counts to the device
    (asynchronously from pinned memory on CUDA); :meth:`compute_slot_mapping` reads the
    committed device state. The CPU device keeps a separate "device" copy too, so that the
    commit semantics are the same everywhere.

    Args:
        block_size: tokens per manager block (the KV cache manager's ``block_size``).
        max_num_reqs: rows (concurrent requests).
        max_num_blocks_per_req: columns: the most blocks one request holds.
        max_num_batched_tokens: length of the slot mapping (tokens per step, CUDA-graph
            padded with :data:`PAD_SLOT_ID`).
        device: where the table and slot mapping live (``"cpu"``, ``"cuda"``, ...).
        pin_memory: pin the host mirror (only on a CUDA device; ignored on CPU).
        kernel_block_size: the attention kernel's block size if smaller than
            ``block_size`` (must divide it); see :meth:`kernel_block_table`.
        kernel_block_stride: kernel blocks between consecutive manager blocks (default
            ``block_size // kernel_block_size``).

    Attributes:
        block_table: the device tensor, int32 ``[max_num_reqs, max_num_blocks_per_req]``.
        block_table_cpu: the host mirror (same shape and dtype).
        num_blocks_per_row: numpy int32 ``[max_num_reqs]`` view of the host counts.
        slot_mapping: int64 ``[max_num_batched_tokens]`` device buffer that
            :meth:`compute_slot_mapping` fills and returns.

    Raises:
        ValueError / TypeError: a non-positive size, a ``kernel_block_size`` that does not
            divide ``block_size``, a ``kernel_block_stride`` below the split factor.
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        device: Any,
        pin_memory: bool = False,
        *,
        kernel_block_size: int | None = None,
        kernel_block_stride: int | None = None,
    ) -> None:
        self.block_size = _positive_int("block_size", block_size)
        self.max_num_reqs = _positive_int("max_num_reqs", max_num_reqs)
        self.max_num_blocks_per_req = _positive_int("max_num_blocks_per_req", max_num_blocks_per_req)
        self.max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.kernel_block_size, self.blocks_per_kv_block, self.kernel_block_stride = _kernel_split(
            self.block_size, kernel_block_size, kernel_block_stride
        )
        self._max_block_id = _max_block_id(self.blocks_per_kv_block, self.kernel_block_stride)
        self.device = _normalize_device(device)
        self.pin_memory = bool(pin_memory) and self.device.type == "cuda" and torch.cuda.is_available()

        shape = (self.max_num_reqs, self.max_num_blocks_per_req)
        self.block_table_cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=self.pin_memory)
        self._table_np = self.block_table_cpu.numpy()
        self._counts_cpu = torch.zeros(self.max_num_reqs, dtype=torch.int32, pin_memory=self.pin_memory)
        self.num_blocks_per_row = self._counts_cpu.numpy()
        self.block_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self._counts_dev = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)
        self.slot_mapping = torch.full(
            (self.max_num_batched_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=self.device
        )
        self._token_arange = torch.arange(self.max_num_batched_tokens, dtype=torch.int64, device=self.device)
        # log2(block_size) for a power of two (shift and mask instead of int64 division), else -1.
        self._shift = self.block_size.bit_length() - 1 if self.block_size & (self.block_size - 1) == 0 else -1
        if self.device.type == "cpu":
            self._slot_np = self.slot_mapping.numpy()
            self._table_dev_np = self.block_table.numpy()
            self._counts_np = self._counts_dev.numpy()
            self._req_arange = np.arange(self.max_num_reqs, dtype=np.int64)
            self._row_base = self._req_arange * self.max_num_blocks_per_req
        self._error = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._dirty = np.zeros(self.max_num_reqs, dtype=bool)
        self._copy_event: Any = None
        self._kernel_table: torch.Tensor | None = None
        self._kernel_arange: torch.Tensor | None = None

    # -- row operations (host mirror) ----------------------------------------------------------
    def _row(self, name: str, row_idx: Any) -> int:
        if isinstance(row_idx, bool) or not isinstance(row_idx, (int, np.integer)):
            raise TypeError(f"{name}: must be an int, got {type(row_idx).__name__}")
        if not 0 <= row_idx < self.max_num_reqs:
            raise IndexError(f"{name}: row {row_idx} is outside [0, {self.max_num_reqs})")
        return int(row_idx)

    def _wait_copy(self) -> None:
        # The host mirror must not change while an async copy may still read it.
        if self._copy_event is not None:
            self._copy_event.synchronize()
            self._copy_event = None

    def _prepare(self, block_ids: Any, row_idx: int, start: int) -> np.ndarray:
        """Validated ids for writing at ``[start, start + n)`` of ``row_idx`` (no change)."""
        arr = _as_block_id_array(block_ids, "block_ids", self._max_block_id)
        end = start + arr.size
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"block_ids: row {row_idx} would hold {end} blocks, more than "
                f"max_num_blocks_per_req={self.max_num_blocks_per_req}"
            )
        return arr

    def _write(self, arr: np.ndarray, row_idx: int, start: int) -> None:
        self._wait_copy()
        self._table_np[row_idx, start : start + arr.size] = arr
        self.num_blocks_per_row[row_idx] = start + arr.size
        self._dirty[row_idx] = True

    def append_row(self, block_ids: Any, row_idx: int) -> None:
        """Append ``block_ids`` after the blocks row ``row_idx`` holds (vLLM ``append_row``):
        the worker calls it with the *new* block ids ``allocate_slots`` returned.

        Args:
            block_ids: 1-D ints (list, tuple, numpy, torch), manager block ids in table order.
            row_idx: the request's row.

        Raises:
            ValueError: a block id outside ``[0, 2**31-1]`` (or whose kernel block ids leave
                int32); the row would exceed ``max_num_blocks_per_req`` (nothing changes).
            TypeError: non-integer ids. IndexError: ``row_idx`` out of range.
        """
        row_idx = self._row("row_idx", row_idx)
        start = int(self.num_blocks_per_row[row_idx])
        arr = self._prepare(block_ids, row_idx, start)
        if arr.size:
            self._write(arr, row_idx, start)

    def add_row(self, block_ids: Any, row_idx: int) -> None:
        """Make row ``row_idx`` hold exactly ``block_ids`` (vLLM ``add_row``: reset, then
        append); entries after them are zeroed. Errors as :meth:`append_row` (nothing
        changes on error)."""
        row_idx = self._row("row_idx", row_idx)
        arr = self._prepare(block_ids, row_idx, 0)
        self._wait_copy()
        old = int(self.num_blocks_per_row[row_idx])
        if old > arr.size:
            self._table_np[row_idx, arr.size : old] = 0
        self._write(arr, row_idx, 0)

    def clear_row(self, row_idx: int) -> None:
        """Zero the used prefix of row ``row_idx`` and set its count to 0 (vLLM ``clear_row``).

        Raises:
            IndexError: ``row_idx`` out of range.
        """
        row_idx = self._row("row_idx", row_idx)
        self._wait_copy()
        n = int(self.num_blocks_per_row[row_idx])
        if n:
            self._table_np[row_idx, :n] = 0
        self.num_blocks_per_row[row_idx] = 0
        self._dirty[row_idx] = True

    def move_row(self, src: int, tgt: int) -> None:
        """Move row ``src`` to row ``tgt`` (vLLM ``move_row``, used when the batch is
        condensed): ``tgt`` gets ``src``'s blocks and count, then ``src`` is zeroed with count
        0 (spec §9). ``src == tgt`` changes nothing.

        Raises:
            IndexError: ``src`` or ``tgt`` out of range.
        """
        src = self._row("src", src)
        tgt = self._row("tgt", tgt)
        if src == tgt:
            return
        self._wait_copy()
        n = int(self.num_blocks_per_row[src])
        old = int(self.num_blocks_per_row[tgt])
        t = self._table_np
        t[tgt, :n] = t[src, :n]
        if old > n:
            t[tgt, n:old] = 0
        t[src, :n] = 0
        self.num_blocks_per_row[tgt] = n
        self.num_blocks_per_row[src] = 0
        self._dirty[[src, tgt]] = True

    def swap_row(self, src: int, tgt: int) -> None:
        """Swap rows ``src`` and ``tgt`` and their counts (vLLM ``swap_row``, used when the
        batch is reordered).

        Raises:
            IndexError: ``src`` or ``tgt`` out of range.
        """
        src = self._row("src", src)
        tgt = self._row("tgt", tgt)
        if src == tgt:
            return
        self._wait_copy()
        pair, rev = [src, tgt], [tgt, src]
        self._table_np[pair] = self._table_np[rev]
        self.num_blocks_per_row[pair] = self.num_blocks_per_row[rev]
        self._dirty[pair] = True

    def commit_block_table(self, num_reqs: int) -> None:
        """Copy the first ``num_reqs`` rows and their counts to the device (vLLM
        ``commit_block_table``): non-blocking from pinned memory on CUDA (later row edits
        wait for the copy), a plain copy on CPU.

        Raises:
            ValueError: ``num_reqs`` outside ``[0, max_num_reqs]``.
        """
        if isinstance(num_reqs, bool) or not isinstance(num_reqs, (int, np.integer)):
            raise TypeError(f"num_reqs: must be an int, got {type(num_reqs).__name__}")
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs: {num_reqs} is outside [0, {self.max_num_reqs}]")
        num_reqs = int(num_reqs)
        if num_reqs == 0:
            return
        async_copy = self.device.type == "cuda"
        self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs], non_blocking=async_copy)
        self._counts_dev[:num_reqs].copy_(self._counts_cpu[:num_reqs], non_blocking=async_copy)
        if async_copy:
            self._copy_event = torch.cuda.Event()
            self._copy_event.record()
        self._dirty[:num_reqs] = False

    def clear(self) -> None:
        """Zero every row and count, on the host and the device (vLLM ``clear``)."""
        self._wait_copy()
        self.block_table.fill_(0)
        self._counts_dev.fill_(0)
        self.block_table_cpu.fill_(0)
        self._counts_cpu.fill_(0)
        self._dirty[:] = False

    # -- views -----------------------------------------------------------------------------------
    def get_device_tensor(self, num_reqs: int | None = None) -> torch.Tensor:
        """The committed device table, int32 ``[num_reqs, max_num_blocks_per_req]`` (all rows
        if ``num_reqs`` is None)."""
        return self.block_table if num_reqs is None else self.block_table[:num_reqs]

    def get_cpu_tensor(self) -> torch.Tensor:
        """The host mirror, int32 ``[max_num_reqs, max_num_blocks_per_req]``."""
        return self.block_table_cpu

    def get_numpy_array(self) -> np.ndarray:
        """The host mirror as a numpy int32 view (edits through it bypass validation and
        dirty tracking)."""
        return self._table_np

    def row(self, row_idx: int) -> list[int]:
        """The block ids row ``row_idx`` holds (host mirror), as a list."""
        row_idx = self._row("row_idx", row_idx)
        return self._table_np[row_idx, : int(self.num_blocks_per_row[row_idx])].tolist()

    def kernel_block_table(self, num_reqs: int | None = None) -> torch.Tensor:
        """The committed device table in kernel blocks, int32
        ``[num_reqs, max_num_blocks_per_req * m]``: entry ``b`` becomes
        ``b * kernel_block_stride + j``, ``j = 0..m-1`` (spec §9; with no split this is
        :meth:`get_device_tensor`). Columns past a row's blocks expand the zero entries, i.e.
        the null block's kernel blocks ``0..m-1``, as vLLM's expansion does. The result is a
        view of a buffer that the next call overwrites.

        Raises:
            ValueError: ``num_reqs`` outside ``[0, max_num_reqs]``.
        """
        nr = self.max_num_reqs if num_reqs is None else int(num_reqs)
        if not 0 <= nr <= self.max_num_reqs:
            raise ValueError(f"num_reqs: {num_reqs} is outside [0, {self.max_num_reqs}]")
        m, s = self.blocks_per_kv_block, self.kernel_block_stride
        if m == 1 and s == 1:
            return self.block_table[:nr]
        if self._kernel_table is None:
            self._kernel_table = torch.zeros(
                (self.max_num_reqs, self.max_num_blocks_per_req * m), dtype=torch.int32, device=self.device
            )
            self._kernel_arange = torch.arange(m, dtype=torch.int32, device=self.device)
        out = self._kernel_table[:nr]
        torch.add(
            self.block_table[:nr].unsqueeze(-1) * s,
            self._kernel_arange,
            out=out.view(nr, self.max_num_blocks_per_req, m),
        )
        return out

    # -- slot mapping ------------------------------------------------------------------------------
    def _check_inputs(self, query_start_loc: Any, positions: Any) -> tuple[int, int]:
        for name, t, dtype in (
            ("query_start_loc", query_start_loc, torch.int32),
            ("positions", positions, torch.int64),
        ):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TypeError(f"{name}: must be {dtype}, got {t.dtype}")
            if not _same_device(t, self.device):
                raise ValueError(f"{name}: must be on the block table's device {self.device}, got {t.device}")
            if t.dim() != 1:
                raise ValueError(f"{name}: must be 1-D, got shape {tuple(t.shape)}")
        num_reqs = query_start_loc.numel() - 1
        if num_reqs < 0:
            raise ValueError("query_start_loc: needs num_reqs + 1 >= 1 entries, got 0")
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"query_start_loc: {num_reqs} requests exceed max_num_reqs={self.max_num_reqs}")
        num_tokens = positions.numel()
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"positions: {num_tokens} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        if self._dirty[:num_reqs].any():
            rows = np.flatnonzero(self._dirty[:num_reqs]).tolist()
            raise RuntimeError(
                f"block table rows {rows[:8]}{'...' if len(rows) > 8 else ''} changed since the last "
                f"commit_block_table; call commit_block_table({num_reqs}) first"
            )
        return num_reqs, num_tokens

    def _qsl_bad(self, qsl: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """0-d bool tensor: query_start_loc is not 0 = q[0] <= q[1] <= ... <= q[-1] = num_tokens."""
        bad = (qsl[0] != 0) | (qsl[-1] != num_tokens)
        if qsl.numel() > 1:
            bad = bad | (qsl[1:] < qsl[:-1]).any()
        return bad

    def _raise_qsl(self, qsl: torch.Tensor, num_tokens: int) -> None:
        q = qsl.tolist()
        if q[0] != 0:
            raise ValueError(f"query_start_loc: must start at 0, got {q[0]}")
        for r in range(len(q) - 1):
            if q[r + 1] < q[r]:
                raise ValueError(
                    f"query_start_loc: must be non-decreasing, got {q[r]} then {q[r + 1]} at index {r}"
                )
        raise ValueError(
            f"query_start_loc: must end at the number of positions ({num_tokens}), got {q[-1]}"
        )

    def _raise_positions(self, qsl: torch.Tensor, positions: torch.Tensor) -> None:
        q = qsl.tolist()
        counts = self._counts_dev[: len(q) - 1].tolist()
        pos = positions.cpu()
        for r in range(len(q) - 1):
            if q[r + 1] <= q[r]:
                continue
            seg = pos[q[r] : q[r + 1]]
            bad = (seg < 0) | (seg // self.block_size >= counts[r])
            if bad.any():
                i = int(torch.nonzero(bad)[0, 0])
                p, t = int(seg[i]), q[r] + i
                if p < 0:
                    raise ValueError(f"positions: token {t} (row {r}) has a negative position {p}")
                raise ValueError(
                    f"positions: token {t} (row {r}) is at position {p}, block index "
                    f"{p // self.block_size}, but row {r} holds {counts[r]} blocks (positions "
                    f"< {counts[r] * self.block_size}); kvblock never reads another row's block "
                    "(vLLM 0.33.0 does, spec §13.4 / CASES.md C22)"
                )
        raise AssertionError("positions: a token was flagged outside its row but none was found")

    def _slot_mapping_torch(
        self, qsl: torch.Tensor, positions: torch.Tensor, num_reqs: int, num_tokens: int
    ) -> torch.Tensor:
        """Vectorized torch slot mapping into ``self.slot_mapping``; returns the count of
        tokens outside their row (0-d tensor)."""
        out = self.slot_mapping
        if num_tokens == 0:
            out.fill_(PAD_SLOT_ID)
            return torch.zeros((), dtype=torch.int64, device=self.device)
        B = self.block_size
        W = self.max_num_blocks_per_req
        tok = self._token_arange[:num_tokens]
        # Request row of every token: how many query ends lie at or before it (a search, not
        # repeat_interleave, so that a malformed query_start_loc cannot index out of bounds).
        # Tokens before query_start_loc[0] or after query_start_loc[-1] belong to no row.
        req = torch.searchsorted(qsl[1:], tok.to(torch.int32), right=True)
        in_req = (req < num_reqs) & (tok >= qsl[0])
        req.clamp_(max=max(num_reqs - 1, 0))
        if self._shift >= 0:
            blk = positions >> self._shift
            off = positions & (B - 1)
        else:
            blk = torch.div(positions, B, rounding_mode="floor")
            off = positions - blk * B
        ok = in_req & (positions >= 0) & (blk < self._counts_dev.index_select(0, req))
        flat = req * W + blk
        bad = ~ok
        flat.masked_fill_(bad, 0)
        o = out[:num_tokens]
        torch.mul(self.block_table.view(-1).index_select(0, flat).to(torch.int64), B, out=o)
        o.add_(off).masked_fill_(bad, PAD_SLOT_ID)
        out[num_tokens:].fill_(PAD_SLOT_ID)
        return bad.sum()

    def _slot_mapping_numpy(
        self, qsl: torch.Tensor, positions: torch.Tensor, num_reqs: int, num_tokens: int
    ) -> int:
        """The CPU path: numpy over the tensors' memory (zero-copy), ``query_start_loc``
        already validated. Returns the count of tokens outside their row.

        The row bounds are checked per request (its largest position against its block
        count) and, only if some request fails, per token with masks."""
        out = self._slot_np
        out[num_tokens:] = PAD_SLOT_ID
        if num_tokens == 0:
            return 0
        B = self.block_size
        q = qsl.numpy()
        p = positions.numpy()
        lens = np.diff(q)
        if self._shift >= 0:
            blk = p >> self._shift
            off = p & (B - 1)
        else:
            blk = p // B
            off = p - blk * B
        nonempty = lens > 0
        max_blk = np.maximum.reduceat(blk, q[:-1][nonempty])
        in_rows = bool((max_blk < self._counts_np[:num_reqs][nonempty]).all()) and int(p.min()) >= 0
        flat = np.repeat(self._row_base[:num_reqs], lens)  # r * width for every token
        o = out[:num_tokens]
        if in_rows:
            flat += blk
            np.multiply(self._table_dev_np.take(flat), B, out=o, dtype=np.int64)
            o += off
            return 0
        req = np.repeat(self._req_arange[:num_reqs], lens)
        bad = blk >= self._counts_np.take(req)
        bad |= p < 0
        flat += blk
        flat[bad] = 0
        np.multiply(self._table_dev_np.take(flat), B, out=o, dtype=np.int64)
        o += off
        o[bad] = PAD_SLOT_ID
        return int(np.count_nonzero(bad))

    def _slot_mapping_triton(
        self, qsl: torch.Tensor, positions: torch.Tensor, num_reqs: int, num_tokens: int
    ) -> torch.Tensor:
        kernel = _triton_kernel()
        self._error.zero_()
        kernel[(num_reqs + 1,)](
            num_tokens,
            self.max_num_batched_tokens,
            qsl,
            positions,
            self.block_table,
            self.block_table.stride(0),
            self._counts_dev,
            self.block_size,
            self.slot_mapping,
            self._error,
            PAD_ID=PAD_SLOT_ID,
            TILE=_TILE,
        )
        return self._error[0]

    def resolve_impl(self, impl: str = "auto") -> str:
        """The slot-mapping implementation ``impl`` selects on this table's device.

        ``"auto"`` is ``"numpy"`` on CPU (vectorized numpy over the tensors' memory: the same
        operations as ``"torch"`` at a fraction of torch's per-operation overhead), and on
        CUDA ``"triton"`` when triton imports, else ``"torch"`` (fused torch ops on the
        device). All give identical results.

        Raises:
            ValueError: an unknown ``impl``, ``"numpy"`` off CPU, or ``"triton"`` without CUDA (the Triton
                interpreter, ``TRITON_INTERPRET=1``, allows it on CPU) or without triton.
        """
        if impl not in _IMPLS:
            raise ValueError(f"impl: must be one of {_IMPLS}, got {impl!r}")
        if impl == "auto":
            if self.device.type == "cpu":
                return "numpy"
            return "triton" if self.device.type == "cuda" and triton_available() else "torch"
        if impl == "numpy" and self.device.type != "cpu":
            raise ValueError(f"impl: 'numpy' needs a CPU table, the table is on {self.device}")
        if impl == "triton":
            if not triton_available():
                raise ValueError("impl: 'triton' requested but triton does not import")
            if self.device.type != "cuda" and not _triton_interpret():
                raise ValueError(
                    f"impl: 'triton' needs a CUDA device (or TRITON_INTERPRET=1), the table is on {self.device}"
                )
        return impl

    def compute_slot_mapping(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        *,
        check: bool = True,
        impl: str = "auto",
    ) -> torch.Tensor:
        """Slot of every scheduled token, padded for CUDA graphs (vLLM 0.33.0
        ``BlockTable.compute_slot_mapping``, spec §9, without context parallelism).

        For request row ``r`` and token ``t`` in ``[query_start_loc[r], query_start_loc[r+1])``
        with ``p = positions[t]``: ``slot[t] = block_table[r, p // B] * B + p % B``
        (``B = block_size``); ``slot[num_tokens:]`` is :data:`PAD_SLOT_ID`. Reads the state of
        the last :meth:`commit_block_table`. vLLM's signature is ``compute_slot_mapping(num_reqs,
        query_start_loc, positions)`` returning None; here ``num_reqs`` is
        ``query_start_loc.numel() - 1`` and the filled buffer is returned.

        Args:
            query_start_loc: int32 ``[num_reqs + 1]`` on the table's device: token offsets,
                starting at 0, non-decreasing, ending at ``positions.numel()``.
            positions: int64 ``[num_tokens]`` on the table's device: token positions in
                their request (0-based).
            check: raise on a position outside its row (on CUDA the value checks cost one
                device-to-host sync per call). With ``check=False`` such a position (or a
                negative one) gets :data:`PAD_SLOT_ID`, never another row's block, and CUDA
                runs without a sync. ``query_start_loc`` is validated whenever that needs no
                sync: always on CPU, on CUDA only with ``check`` (unchecked, a malformed one
                gives unspecified slots but memory accesses stay in bounds).
            impl: ``"auto"``, ``"numpy"`` (CPU), ``"torch"`` or ``"triton"`` (see
                :meth:`resolve_impl`); all give identical results.

        Returns:
            :attr:`slot_mapping`: int64 ``[max_num_batched_tokens]`` on the device. The buffer
            is reused: the next call overwrites it.

        Raises:
            TypeError: an argument that is not a tensor, or of the wrong dtype.
            ValueError: an argument on another device or not 1-D; more requests than
                ``max_num_reqs`` or tokens than ``max_num_batched_tokens``; a
                ``query_start_loc`` that does not start at 0, decreases, or does not end
                at ``positions.numel()`` (named ``query_start_loc``); with ``check``, a
                negative position, or a
                position at or past ``num_blocks_per_row[r] * block_size`` (named
                ``positions``; vLLM 0.33.0 silently reads the next row, CASES.md C22).
            RuntimeError: rows ``< num_reqs`` changed since the last commit.
        """
        num_reqs, num_tokens = self._check_inputs(query_start_loc, positions)
        impl = self.resolve_impl(impl)
        on_host = self.device.type == "cpu"
        if on_host:
            q = query_start_loc.numpy()
            if q[0] != 0 or q[-1] != num_tokens or (num_reqs and (np.diff(q) < 0).any()):
                self._raise_qsl(query_start_loc, num_tokens)
        if impl == "numpy":
            n_bad = self._slot_mapping_numpy(query_start_loc, positions, num_reqs, num_tokens)
        elif impl == "triton":
            n_bad = self._slot_mapping_triton(query_start_loc, positions, num_reqs, num_tokens)
        else:
            n_bad = self._slot_mapping_torch(query_start_loc, positions, num_reqs, num_tokens)
        if check:
            if on_host:
                if int(n_bad):
                    self._raise_positions(query_start_loc, positions)
            else:
                qsl_bad, tok_bad = torch.stack(
                    [self._qsl_bad(query_start_loc, num_tokens).to(torch.int64), n_bad.to(torch.int64)]
                ).tolist()
                if qsl_bad:
                    self._raise_qsl(query_start_loc, num_tokens)
                if tok_bad:
                    self._raise_positions(query_start_loc, positions)
        return self.slot_mapping

    def __repr__(self) -> str:
        return (
            f"BlockTable(block_size={self.block_size}, max_num_reqs={self.max_num_reqs}, "
            f"max_num_blocks_per_req={self.max_num_blocks_per_req}, "
            f"max_num_batched_tokens={self.max_num_batched_tokens}, device={self.device}"
            + (
                f", kernel_block_size={self.kernel_block_size}, kernel_block_stride={self.kernel_block_stride}"
                if self.blocks_per_kv_block > 1 or self.kernel_block_stride != 1
                else ""
            )
            + ")"
        )


# -- MultiGroupBlockTable ----------------------------------------------------------------------
class MultiGroupBlockTable:
    """One :class:`BlockTable` per KV-cache group; every call fans out (vLLM 0.33.0
    ``MultiGroupBlockTable``).

    Args:
        block_sizes: each group's manager block size (tokens).
        max_num_reqs: rows.
        max_model_len: longest request (tokens); group ``g`` gets
            ``get_block_table_width(cdiv(max_model_len, block_sizes[g]), block_sizes[g],
            token_alignment)`` columns unless ``max_num_blocks`` is given.
        max_num_batched_tokens: slot-mapping length.
        device, pin_memory: as :class:`BlockTable`.
        kernel_block_sizes: each group's kernel block size (default: its block size).
        kernel_block_strides: each group's kernel block stride (default: the split factor).
        max_num_blocks: each group's column count, used as given (no alignment).
        token_alignment: see :func:`get_block_table_width`.

    Raises:
        ValueError: per-group lists whose lengths differ from ``block_sizes``, and every
            :class:`BlockTable` error (naming the argument).
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: Any,
        pin_memory: bool = False,
        *,
        kernel_block_sizes: Sequence[int] | None = None,
        kernel_block_strides: Sequence[int | None] | None = None,
        max_num_blocks: Sequence[int] | None = None,
        token_alignment: int = 128,
    ) -> None:
        block_sizes = list(block_sizes)
        if not block_sizes:
            raise ValueError("block_sizes: needs at least one group")
        n = len(block_sizes)
        max_model_len = _positive_int("max_model_len", max_model_len)
        for name, seq in (
            ("kernel_block_sizes", kernel_block_sizes),
            ("kernel_block_strides", kernel_block_strides),
            ("max_num_blocks", max_num_blocks),
        ):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{name}: has {len(seq)} entries, block_sizes has {n}")
        if max_num_blocks is None:
            max_num_blocks = [
                get_block_table_width(_cdiv(max_model_len, _positive_int("block_sizes", bs)), bs, token_alignment)
                for bs in block_sizes
            ]
        kbs = list(kernel_block_sizes) if kernel_block_sizes is not None else [None] * n
        kst = list(kernel_block_strides) if kernel_block_strides is not None else [None] * n
        self.block_tables = [
            BlockTable(
                block_sizes[g],
                max_num_reqs,
                max_num_blocks[g],
                max_num_batched_tokens,
                device,
                pin_memory,
                kernel_block_size=kbs[g],
                kernel_block_stride=kst[g],
            )
            for g in range(n)
        ]

    def _per_group(self, block_ids: Any) -> tuple[Any, ...]:
        groups = tuple(block_ids)
        if len(groups) != len(self.block_tables):
            raise ValueError(
                f"block_ids: has {len(groups)} groups, the table has {len(self.block_tables)}"
            )
        return groups

    def append_row(self, block_ids: Sequence[Any], row_idx: int) -> None:
        """``block_ids[g]`` appended to row ``row_idx`` of group ``g`` (e.g. the tuple
        ``KVCacheBlocks.get_block_ids()`` returns). Every group is validated before any
        changes. Errors as :meth:`BlockTable.append_row`."""
        groups = self._per_group(block_ids)
        arrs = []
        for bt, ids in zip(self.block_tables, groups):
            r = bt._row("row_idx", row_idx)
            arrs.append(bt._prepare(ids, r, int(bt.num_blocks_per_row[r])))
        for bt, arr in zip(self.block_tables, arrs):
            r = int(row_idx)
            if arr.size:
                bt._write(arr, r, int(bt.num_blocks_per_row[r]))

    def add_row(self, block_ids: Sequence[Any], row_idx: int) -> None:
        """Row ``row_idx`` of group ``g`` set to ``block_ids[g]``; validated before any
        change. Errors as :meth:`BlockTable.add_row`."""
        groups = self._per_group(block_ids)
        for bt, ids in zip(self.block_tables, groups):
            bt._prepare(ids, bt._row("row_idx", row_idx), 0)
        for bt, ids in zip(self.block_tables, groups):
            bt.add_row(ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        """:meth:`BlockTable.clear_row` on every group's table (``IndexError`` out of range)."""
        for bt in self.block_tables:
            bt.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        """:meth:`BlockTable.move_row` on every group's table (``IndexError`` out of range)."""
        for bt in self.block_tables:
            bt.move_row(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        """:meth:`BlockTable.swap_row` on every group's table (``IndexError`` out of range)."""
        for bt in self.block_tables:
            bt.swap_row(src, tgt)

    def commit_block_table(self, num_reqs: int) -> None:
        """:meth:`BlockTable.commit_block_table` on every group's table (``ValueError`` for
        ``num_reqs`` outside ``[0, max_num_reqs]``).
        """
        for bt in self.block_tables:
            bt.commit_block_table(num_reqs)

    def clear(self) -> None:
        """:meth:`BlockTable.clear` on every group's table."""
        for bt in self.block_tables:
            bt.clear()

    def compute_slot_mapping(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        *,
        check: bool = True,
        impl: str = "auto",
    ) -> tuple[torch.Tensor, ...]:
        """Each group's :meth:`BlockTable.compute_slot_mapping` (its buffer), in group order."""
        return tuple(
            bt.compute_slot_mapping(query_start_loc, positions, check=check, impl=impl)
            for bt in self.block_tables
        )

    def __getitem__(self, idx: int) -> BlockTable:
        """The :class:`BlockTable` of group ``idx``."""
        return self.block_tables[idx]

    def __len__(self) -> int:
        return len(self.block_tables)
