"""vLLM's ``KVCacheConfig`` as kvblock's KV-cache groups, and which path a configuration takes.

kvblock manages the groups whose vLLM manager class it implements (full attention and its
MLA / hidden-state / sink / R-SWA variants, sliding window, chunked local attention, Mamba in
"none" and "align" modes, cross attention, circular buffers), with or without vLLM's KV-cache
residency metrics (a ``metrics_collector``: :mod:`kvblock.vllm.metrics`). Anything else falls
back to vLLM's own manager, with the reason: :func:`describe` names it.

HiSparse configurations (``hisparse_host_num_blocks`` with a ``HISPARSE_SOURCE`` group) are
translated (``hisparse_source`` / ``hisparse_resident`` / ``hisparse_hot`` groups, the indexer as
full attention): kvblock's Rust manager holds the host pool and the residency, and
``kvblock.vllm.hisparse`` has the views vLLM's HiSparse connector reads (``docs/hisparse.md``).
With a ``metrics_collector`` the host pool records residency metrics into a collector of its own,
as vLLM's ``bind_host_pool`` gives it one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._env import env_flag

__all__ = ["Path", "describe", "env_flag", "translate"]


@dataclass(frozen=True)
class Path:
    """Which manager a configuration gets: ``"kvblock"`` or ``"vllm"`` (the fallback), and
    why (``reason`` is empty on kvblock's path)."""

    manager: str
    reason: str = ""
    groups: list[dict[str, Any]] = field(default_factory=list, repr=False)
    #: ``kv_cache_config.hisparse_host_num_blocks`` (None: no HiSparse host tier).
    hisparse_host_num_blocks: int | None = None

    @property
    def on_kvblock(self) -> bool:
        """True when kvblock manages the configuration (False: vLLM's own manager, for
        ``reason``)."""
        return self.manager == "kvblock"

    def __str__(self) -> str:
        return "kvblock" if self.on_kvblock else f"vLLM's own manager: {self.reason}"


def _kinds() -> dict[type, str]:
    from vllm.v1.core import single_type_kv_cache_manager as st

    return {
        st.HiSparseSourceManager: "hisparse_source",
        st.HiSparseResidentManager: "hisparse_resident",
        st.HiSparseHotManager: "hisparse_hot",
        st.FullAttentionManager: "full_attention",
        st.SinkFullAttentionManager: "full_attention",
        st.RSWAManager: "rswa",
        st.SlidingWindowManager: "sliding_window",
        st.ChunkedLocalAttentionManager: "chunked_local_attention",
        st.MambaManager: "mamba",
        st.CrossAttentionManager: "cross_attention",
        st.CircularBufferManager: "circular_buffer",
    }


def translate(
    kv_cache_config: Any,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    metrics_collector: Any = None,
    enable_caching: bool = True,
    use_eagle: bool = True,
) -> Path:
    """The kvblock groups of ``kv_cache_config`` (vLLM's ``KVCacheConfig``), or the reason
    kvblock does not manage it."""
    from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec, KVCacheGroupRole, MambaSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    host_num_blocks = getattr(kv_cache_config, "hisparse_host_num_blocks", None)
    hisparse_roles = (
        {KVCacheGroupRole.HISPARSE_SOURCE, KVCacheGroupRole.HISPARSE_INDEXER} if host_num_blocks is not None else set()
    )
    if metrics_collector is not None:
        from .metrics import unsupported_reason

        reason = unsupported_reason(metrics_collector, kv_cache_config.num_blocks)
        if reason is not None:
            return Path("vllm", f"KV cache residency metrics: {reason}")
    kinds = _kinds()
    groups: list[dict[str, Any]] = []
    classes: list[tuple[Any, type]] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        role = getattr(group, "role", None)
        if role is not None and role != KVCacheGroupRole.DEFAULT and role not in hisparse_roles:
            return Path("vllm", f"kv_cache_groups[{i}] has role {getattr(role, 'value', role)!s} (HiSparse groups)")
        manager_cls = KVCacheSpecRegistry.get_manager_class(spec, role)
        kind = kinds.get(manager_cls)  # type: ignore[arg-type]
        if kind is None:
            name = manager_cls.__name__ if manager_cls is not None else "no manager"
            return Path("vllm", f"kv_cache_groups[{i}]: {type(spec).__name__} ({name}) is a group type kvblock does not manage")
        cls = next((j for j, (s, m) in enumerate(classes) if s == spec and m is manager_cls), None)
        if cls is None:
            classes.append((spec, manager_cls))
            cls = len(classes) - 1
        g: dict[str, Any] = {
            "kind": kind,
            "block_size": spec.block_size,
            "prefix_cacheable": spec.prefix_cacheable,
            "dcp_sharded": spec.dcp_sharded,
            "is_eagle_group": group.is_eagle_group,
            "zeroed": isinstance(spec, AttentionSpec) and not isinstance(spec, CircularBufferSpec),
            "spec_class": cls,
        }
        if kind == "rswa":
            g["rswa_window"] = spec.rswa_window
        elif kind == "sliding_window":
            g["sliding_window"] = spec.sliding_window
            g["extra_retained_tokens"] = getattr(spec, "extra_retained_tokens", 0)
        elif kind == "chunked_local_attention":
            g["attention_chunk_size"] = spec.attention_chunk_size
        elif kind == "hisparse_hot":
            g["blocks_per_request"] = spec.blocks_per_request
        elif kind == "mamba":
            assert isinstance(spec, MambaSpec)
            g.update(
                # vLLM 0.32-0.34 know "align" and "none" (CacheConfig's MambaCacheMode); their
                # MambaManager runs every mode other than "align" as it runs "none"
                mamba_cache_mode="align" if spec.mamba_cache_mode == "align" else "none",
                num_speculative_blocks=spec.num_speculative_blocks,
                num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
                prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
            )
        groups.append(g)
    return Path("kvblock", "", groups, host_num_blocks)


def describe(
    kv_cache_config: Any,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    metrics_collector: Any = None,
    enable_caching: bool = True,
    use_eagle: bool = True,
) -> Path:
    """Which manager ``kv_cache_config`` gets with kvblock swapped in, and why: a
    :class:`Path` whose ``str()`` is ``"kvblock"`` or ``"vLLM's own manager: <reason>"``."""
    return translate(kv_cache_config, dcp_world_size, pcp_world_size, metrics_collector, enable_caching, use_eagle)
