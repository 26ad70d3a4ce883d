"""The vLLM releases kvblock runs inside, and everything that differs between them.

kvblock.vllm supports a window of vLLM releases (:data:`WINDOW`). What changed between them in
the surface kvblock stands in for lives here, as one :class:`Release` record per series, and
nowhere else: the rest of ``kvblock.vllm`` asks :func:`current` (the installed release) and
never compares version strings itself.

:func:`check` is called when ``kvblock.vllm`` is imported, so both ways of turning kvblock on
(``--scheduler-cls kvblock.vllm.Scheduler`` and the plugin / :func:`kvblock.vllm.patch`)
refuse a release outside the window before any engine state exists.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Release", "UnsupportedVllmRelease", "WINDOW", "check", "current", "model_runner_output", "window_text"]


@dataclass(frozen=True)
class Release:
    """What one vLLM release series looks like to kvblock.

    Attributes:
        series: ``"0.34"``.
        hit_limit_field: the ``Request`` attribute that bounds a prefix-cache hit:
            ``"skip_reading_prefix_cache"`` (a bool: True reads nothing; 0.32, 0.33) or
            ``"prefix_cache_hit_limit"`` (``0`` reads nothing, ``N`` at most N tokens, ``None``
            unbounded; 0.34).
        hash_lookahead: ``KVCacheManager`` / ``BlockPool`` take ``num_hash_lookahead_tokens``
            (0.33+). On 0.32 kvblock runs with no lookahead, as 0.32 does.
        lookup_bound: ``get_computed_blocks`` takes ``max_cache_hit_length`` (0.33+).
        num_cached_tokens_probe: ``KVCacheManager.get_num_cached_tokens`` exists (0.34: the
            scheduler's cache-aware admission calls it).
        free_evict_first: ``BlockPool.free_blocks(ordered_blocks, evict_first=False)`` (0.34).
        public_pool_helpers: ``BlockPool.generate_event_extra_keys`` and
            ``get_lookahead_token_ids`` are public (0.34; 0.33 has them with a leading ``_``,
            0.32 has neither).
        block_hash_map_ids: ``BlockHashToBlockMap`` is built on the pool's blocks and stores
            block ids (``_cache``: one id per key, ``_dup_ids``: the duplicates), with
            ``clear()`` (0.34); before, it stored blocks.
        token_buffer: request token ids are a ``vllm.v1.token_buffer.TokenBuffer`` (an
            ``array('i')`` subclass) rather than a list (0.34).
        common_prefix_blocks: ``KVCacheManager.get_num_common_prefix_blocks`` exists
            (deprecated in 0.33, removed in 0.34).
        eagle_groups_drop_always: a group flagged ``is_eagle_group`` drops the EAGLE block from
            its hits even with ``use_eagle`` off (0.32: the coordinator's ``eagle_group_ids``
            decide the drop; 0.33 added ``drop_eagle_group_ids``, empty without ``use_eagle``).
            kvblock's Rust core applies the installed release's rule (:meth:`core_rules`).
        null_blocks_counted: ``pop_blocks_for_free`` and ``get_blocks`` return a table's leading
            null blocks, and freeing counts the null block's ``ref_cnt`` down (0.32; from 0.33
            both skip the null block, "never pooled; its ref_cnt is not maintained"). The blocks
            freed are the same; kvblock follows 0.33 on every release (a deliberate
            difference on 0.32, listed in the docs).
        runner_output_index: ``ModelRunnerOutput`` takes ``req_id_to_index`` (0.32, 0.33; 0.34
            dropped it): see :func:`model_runner_output`.
        mamba_prefix_caching_differs: vLLM 0.32's Mamba prefix caching: a Mamba group in
            ``mamba_cache_mode="none"`` takes part in prefix caching (0.33 asserts "align"), and
            ``_cache_partial_tail_block`` registers the prompt's last boundary state again when
            its block already carries that key, marking it cached this step (0.33 leaves an
            already keyed block alone). 0.32's tables also keep their null blocks in what
            ``pop_blocks_for_free`` / ``get_blocks`` return: that is ``null_blocks_counted``.
            kvblock's Rust core applies the installed release's rules (:meth:`core_rules`)
            (found by the lockstep against vLLM 0.32 from random seeds).
        hisparse_after_forward: HiSparse's ``SparseKVPageTransfer`` has an ``after_forward``
            field (0.32, 0.33: True for a write-back planned by ``advance_scheduled``, False for
            an import's restore); 0.34 dropped it. See ``docs/hisparse.md``.
        hisparse_import_reservations: HiSparse's coordinator reserves the host pages an
            admitted import has yet to allocate (``size_import``, ``update_import_reservation``,
            ``reserved_import_pages``; 0.34).
        hisparse_trim_null_head: ``HiSparseResidentManager.pop_blocks_for_free`` trims the
            row's leading null (host-only) pages (0.33+, ``trim_null_head``); 0.32 returns the
            row whole. kvblock's Rust core applies it (:meth:`core_rules`).
        eagle_junction_block_retained: the base ``cache_blocks`` also keeps the block before a
            shared-prefix junction under EAGLE (``shared_prefix_boundary - block_size`` among
            the reachable boundaries of sparse retention; 0.33+, not 0.32).
    """

    series: str
    hit_limit_field: str
    hash_lookahead: bool
    lookup_bound: bool
    num_cached_tokens_probe: bool
    free_evict_first: bool
    public_pool_helpers: bool
    block_hash_map_ids: bool
    token_buffer: bool
    common_prefix_blocks: bool
    mamba_prefix_caching_differs: bool
    runner_output_index: bool
    eagle_groups_drop_always: bool
    null_blocks_counted: bool
    hisparse_after_forward: bool
    hisparse_import_reservations: bool
    hisparse_trim_null_head: bool
    eagle_junction_block_retained: bool

    def core_rules(self) -> dict[str, bool]:
        """This release's rules as kvblock's Rust core takes them (``KVCacheManagerCore``'s
        ``release_rules``: ``rust/src/manager/release.rs``, whose defaults are 0.33's)."""
        return {
            "eagle_groups_drop_always": self.eagle_groups_drop_always,
            "mamba_none_mode_caches": self.mamba_prefix_caching_differs,
            "partial_tail_rekeyed": self.mamba_prefix_caching_differs,
            "eagle_junction_block_retained": self.eagle_junction_block_retained,
            "hisparse_trim_null_head": self.hisparse_trim_null_head,
        }


_V032 = Release(
    series="0.32",
    hit_limit_field="skip_reading_prefix_cache",
    hash_lookahead=False,
    lookup_bound=False,
    num_cached_tokens_probe=False,
    free_evict_first=False,
    public_pool_helpers=False,
    block_hash_map_ids=False,
    token_buffer=False,
    common_prefix_blocks=True,
    mamba_prefix_caching_differs=True,
    runner_output_index=True,
    eagle_groups_drop_always=True,
    null_blocks_counted=True,
    hisparse_after_forward=True,
    hisparse_import_reservations=False,
    hisparse_trim_null_head=False,
    eagle_junction_block_retained=False,
)
# each release as what it changed from the one before
_V033 = replace(
    _V032,
    series="0.33",
    hash_lookahead=True,
    lookup_bound=True,
    mamba_prefix_caching_differs=False,
    eagle_groups_drop_always=False,
    null_blocks_counted=False,
    eagle_junction_block_retained=True,
    hisparse_trim_null_head=True,
)
_V034 = replace(
    _V033,
    series="0.34",
    hit_limit_field="prefix_cache_hit_limit",
    num_cached_tokens_probe=True,
    free_evict_first=True,
    public_pool_helpers=True,
    block_hash_map_ids=True,
    token_buffer=True,
    common_prefix_blocks=False,
    runner_output_index=False,
    hisparse_after_forward=False,
    hisparse_import_reservations=True,
)
_RELEASES = {r.series: r for r in (_V032, _V033, _V034)}

#: The vLLM release series kvblock supports, oldest first.
WINDOW: tuple[str, ...] = tuple(_RELEASES)


class UnsupportedVllmRelease(RuntimeError):
    """The installed vLLM is outside :data:`WINDOW`."""


def window_text() -> str:
    """``"0.32.x, 0.33.x and 0.34.x"``."""
    names = [f"{s}.x" for s in WINDOW]
    return ", ".join(names[:-1]) + " and " + names[-1]


def _series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def release_of(version: str) -> Release:
    """The :class:`Release` of a vLLM version string (``"0.34.0"``, ``"0.32.0+cpu"``).

    Raises:
        UnsupportedVllmRelease: a version outside :data:`WINDOW`, naming the window.
    """
    from .. import __version__

    release = _RELEASES.get(_series(version))
    if release is None:
        raise UnsupportedVllmRelease(
            f"kvblock {__version__} supports vLLM {window_text()}; the installed vLLM is {version}. "
            f"Install a vLLM in that window, or turn kvblock off (unset KVBLOCK_VLLM, drop "
            f"--scheduler-cls kvblock.vllm.Scheduler)."
        )
    return release


_current: Release | None = None


def current() -> Release:
    """The installed vLLM's :class:`Release` (read once per process).

    Raises:
        UnsupportedVllmRelease: the installed vLLM is outside :data:`WINDOW`.
    """
    global _current
    if _current is None:
        import vllm

        _current = release_of(getattr(vllm, "__version__", "unknown"))
    return _current


def check() -> Release:
    """:func:`current`, for the import of ``kvblock.vllm``: raises
    :class:`UnsupportedVllmRelease` outside the window."""
    return current()


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]]) -> Any:
    """vLLM's ``ModelRunnerOutput`` for a step that sampled ``sampled_token_ids[i]`` for
    ``req_ids[i]``, built as the installed release takes it (0.32 / 0.33 also want
    ``req_id_to_index``): for driving vLLM's scheduler without a model (benchmarks, the
    scheduler demo, tests)."""
    from vllm.v1.outputs import ModelRunnerOutput

    extra: dict[str, Any] = {}
    if current().runner_output_index:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=sampled_token_ids, **extra)
