"""KV-cache group specs for :class:`kvblock.KVCacheManager` (any engine), mirroring vLLM
0.33.0's ``KVCacheSpec`` classes (spec §6): what each group of a model's layers keeps.

``KVCacheManager(num_blocks, kv_cache_groups=[FullAttentionSpec(16), SlidingWindowSpec(16,
sliding_window=128)])`` builds a hybrid manager: one block pool, one single-type manager per
group, and vLLM's coordinator rules (a hit is the longest prefix every group agrees on).

Only the fields that shape block management are kept (no head counts or dtypes): the group
kind, ``block_size`` (tokens per block) and the kind's window parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd, lcm
from typing import Any, Sequence

__all__ = [
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "MambaSpec",
    "RSWASpec",
    "SlidingWindowSpec",
    "resolve_block_sizes",
]


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: must be > 0, got {value}")


def _non_negative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")


#: The largest block size a spec takes (block ids and offsets stay in int32 slot arithmetic).
MAX_BLOCK_SIZE = 2**31 - 1


@dataclass(frozen=True)
class KVCacheSpec:
    """A group's layers' KV cache. ``block_size``: tokens per block (> 0)."""

    block_size: int

    #: The group kind the Rust core manages (vLLM's manager class).
    kind = ""
    #: vLLM's ``KVCacheSpecKind`` value (reported in KV events).
    spec_kind = "unknown"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size: at most {MAX_BLOCK_SIZE} tokens per block, got {self.block_size}")

    @property
    def dcp_sharded(self) -> bool:
        """Whether decode context parallelism spreads the group's token positions over its
        ranks (attention groups, as vLLM's ``AttentionSpec``; a Mamba state is not)."""
        return True

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the group takes part in prefix caching."""
        return True

    @property
    def sliding_window(self) -> int | None:  # overridden by sliding-window specs
        """The attention window in tokens (``int``) for sliding-window specs, else None."""
        return None

    def _core(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size, "prefix_cacheable": self.prefix_cacheable}


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Full attention: every block of a request is kept until it finishes."""

    kind = "full_attention"
    spec_kind = "full_attention"


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention: full attention over the prompt, and a decode
    window of ``rswa_window`` tokens; the gap between them is freed."""

    rswa_window: int
    kind = "rswa"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("rswa_window", self.rswa_window)

    def _core(self) -> dict[str, Any]:
        return {**super()._core(), "rswa_window": self.rswa_window}


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Sliding-window attention over the last ``sliding_window`` tokens; blocks that leave
    the window are freed. ``extra_retained_tokens`` more trailing tokens are kept (multi-token
    prediction re-prefill)."""

    sliding_window: int = 0  # type: ignore[assignment]
    extra_retained_tokens: int = 0
    kind = "sliding_window"
    spec_kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("sliding_window", self.sliding_window)
        _non_negative("extra_retained_tokens", self.extra_retained_tokens)

    def _core(self) -> dict[str, Any]:
        return {
            **super()._core(),
            "sliding_window": self.sliding_window,
            "extra_retained_tokens": self.extra_retained_tokens,
        }


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(KVCacheSpec):
    """Chunked local attention (Llama 4): tokens attend within their chunk of
    ``attention_chunk_size`` tokens; earlier chunks are freed."""

    attention_chunk_size: int = 0
    kind = "chunked_local_attention"
    spec_kind = "chunked_local_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("attention_chunk_size", self.attention_chunk_size)

    def _core(self) -> dict[str, Any]:
        return {**super()._core(), "attention_chunk_size": self.attention_chunk_size}


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Mamba / linear-attention state. ``mamba_cache_mode``: ``"none"`` (one running state,
    no prefix caching) or ``"align"`` (states kept at block boundaries and cached; required
    for prefix caching). ``num_speculative_blocks``: extra state blocks for speculative
    decoding; ``num_prefill_checkpoint_blocks`` / ``prefill_checkpoint_alignment``: prefill
    checkpoints inside long chunks ("align" only)."""

    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    kind = "mamba"
    spec_kind = "mamba"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba_cache_mode not in ("none", "align"):
            raise ValueError(f"mamba_cache_mode: 'none' or 'align', got {self.mamba_cache_mode!r}")
        _non_negative("num_speculative_blocks", self.num_speculative_blocks)
        _non_negative("num_prefill_checkpoint_blocks", self.num_prefill_checkpoint_blocks)
        if self.prefill_checkpoint_alignment is not None:
            _positive("prefill_checkpoint_alignment", self.prefill_checkpoint_alignment)

    @property
    def dcp_sharded(self) -> bool:
        """False: a Mamba state is not spread over decode-context-parallel ranks."""
        return False

    def _core(self) -> dict[str, Any]:
        return {
            **super()._core(),
            "mamba_cache_mode": self.mamba_cache_mode,
            "num_speculative_blocks": self.num_speculative_blocks,
            "num_prefill_checkpoint_blocks": self.num_prefill_checkpoint_blocks,
            "prefill_checkpoint_alignment": self.prefill_checkpoint_alignment,
            "dcp_sharded": False,
        }


@dataclass(frozen=True)
class CrossAttentionSpec(KVCacheSpec):
    """Cross attention of encoder-decoder models: blocks for the encoder tokens
    (``num_encoder_tokens`` of ``allocate_slots``), never cached."""

    kind = "cross_attention"
    spec_kind = "cross_attention"


@dataclass(frozen=True)
class CircularBufferSpec(KVCacheSpec):
    """One ring block per request for its lifetime, never cached."""

    kind = "circular_buffer"
    spec_kind = "unknown"

    @property
    def prefix_cacheable(self) -> bool:
        """False: a ring block is never prefix-cached."""
        return False


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """A KV-cache group: its spec, and whether it is an EAGLE/MTP draft group (hits drop the
    block EAGLE recomputes)."""

    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    layer_names: list[str] = field(default_factory=list, compare=False)


def _groups(kv_cache_groups: Sequence[Any]) -> list[KVCacheGroupSpec]:
    if isinstance(kv_cache_groups, (str, bytes)) or not isinstance(kv_cache_groups, Sequence):
        raise TypeError("kv_cache_groups: expected a list of KV-cache specs")
    if not kv_cache_groups:
        raise ValueError("kv_cache_groups: empty (a model has at least one KV-cache group)")
    out = []
    for i, g in enumerate(kv_cache_groups):
        if isinstance(g, KVCacheSpec):
            g = KVCacheGroupSpec(g)
        if not isinstance(g, KVCacheGroupSpec) or not isinstance(g.kv_cache_spec, KVCacheSpec):
            raise TypeError(f"kv_cache_groups[{i}]: expected a kvblock.specs spec, got {type(g).__name__}")
        out.append(g)
    return out


def core_groups(groups: Sequence[KVCacheGroupSpec]) -> list[dict[str, Any]]:
    """The groups as the Rust core takes them; equal specs share a class (looked up
    together)."""
    classes: list[KVCacheSpec] = []
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        cls = next((i for i, s in enumerate(classes) if s == spec and type(s) is type(spec)), None)
        if cls is None:
            classes.append(spec)
            cls = len(classes) - 1
        out.append({**spec._core(), "is_eagle_group": g.is_eagle_group, "spec_class": cls})
    return out


def resolve_block_sizes(
    groups: Sequence[KVCacheGroupSpec],
    enable_caching: bool = True,
    hash_block_size: int | None = None,
    dcp_world_size: int = 1,
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` as vLLM's ``resolve_kv_cache_block_sizes``
    picks them: one group hashes at its block size; several schedule at the LCM of their
    block sizes and hash at the GCD of the prefix-cacheable ones (or ``hash_block_size``,
    which must divide them); a Mamba group not in "align" mode, or caching off, hashes at the
    scheduler block size. Under decode context parallelism (``dcp_world_size`` > 1) an
    attention group's block spans ``block_size * dcp_world_size`` tokens (vLLM's
    ``resolve_dcp_kv_block_size``); a Mamba group's does not.

    Raises:
        TypeError: a ``hash_block_size`` that is not an int.
        ValueError: a ``hash_block_size`` that is not positive or does not divide the group
            block sizes.
    """
    if hash_block_size is not None:
        _positive("hash_block_size", hash_block_size)
    _positive("dcp_world_size", dcp_world_size)
    sizes = [g.kv_cache_spec.block_size * (dcp_world_size if g.kv_cache_spec.dcp_sharded else 1) for g in groups]
    if len(groups) == 1:
        bs = sizes[0]
        if hash_block_size not in (None, bs) and enable_caching:
            raise ValueError(
                f"hash_block_size: with one KV-cache group, hits land on the block size ({bs}); got {hash_block_size}"
            )
        return bs, bs
    scheduler = lcm(*sizes)
    if not enable_caching:
        return scheduler, scheduler if hash_block_size is None else hash_block_size
    if any(isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.mamba_cache_mode != "align" for g in groups):
        return scheduler, scheduler
    cacheable = [b for g, b in zip(groups, sizes) if g.kv_cache_spec.prefix_cacheable] or sizes
    h = hash_block_size if hash_block_size is not None else gcd(*cacheable)
    if any(b % h for b in cacheable):
        raise ValueError(
            f"hash_block_size: {h} must divide every prefix-cacheable group's block size {cacheable}"
        )
    return scheduler, h
