//! The HiSparse groups' own rules (vLLM's `HiSparseSourceManager`, `HiSparseResidentManager`
//! and `HiSparseHotManager` in `single_type_kv_cache_manager.py`, 0.32 to 0.34): their block
//! counts, their allocations and what they return when a request is freed.
//!
//! The coordinator's state these rules read is an input here, never a global: the resident
//! group's residency overlay (vLLM's `residency_changes[request]`, kept by
//! [`crate::hisparse::residency::Residency`]), whether the request is in a hot group's
//! `hot_required`, the device pool's size for the source group's admission sentinel and, on
//! 0.34, the import reservations. The calls into the coordinator that vLLM's managers make
//! (`commit_computed_blocks`, `require_hot`, `size_import`, `free`) are the caller's: each
//! function says which one follows it.
//!
//! Block ids are those of the group's own pool: the host pool for the source group, the
//! device pool for the resident and hot groups.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::manager::group_state::{cdiv, ReqState, TypeConfig};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};

/// 0.34's import sizing in the source group's admission count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportStep {
    /// The coordinator's `import_step_tokens`.
    pub import_step_tokens: usize,
    /// The coordinator's `reserved_import_pages` (host pages held for other imports).
    pub reserved_import_pages: usize,
}

/// What the source group's `get_num_blocks_to_allocate` returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceCount {
    /// The device-pool count: 0 (host blocks never count against the device pool), or the
    /// admission sentinel `device_num_blocks + 1` when the host pool cannot back the request.
    pub blocks: usize,
    /// 0.34: the pages to pass to the coordinator's `size_import(request, pages)` (an
    /// admission-capped external import); None otherwise.
    pub size_import: Option<usize>,
}

/// `HiSparseSourceManager.get_num_blocks_to_allocate`: the full-attention count on the host
/// pool (`host`, without the admission cap), compared with the host pool's free blocks.
/// `import_step` is 0.34's (None on 0.32 / 0.33): when `apply_admission_cap` and the request
/// imports external tokens (`total_computed > num_local_computed`), the request is sized
/// `import_step_tokens` further and the host pages reserved for other imports are not free.
#[allow(clippy::too_many_arguments)] // vLLM's signature plus the coordinator's inputs
pub fn source_num_blocks_to_allocate(
    cfg: &TypeConfig,
    host: &BlockPool,
    st: &ReqState,
    num_tokens: usize,
    new_computed: &[u32],
    total_computed: usize,
    num_local_computed: usize,
    apply_admission_cap: bool,
    device_num_blocks: usize,
    import_step: Option<ImportStep>,
) -> Result<SourceCount> {
    let mut available = host.num_free_blocks() as i64;
    let mut num_tokens = num_tokens;
    let mut size_import = None;
    if let Some(step) = import_step {
        if apply_admission_cap && total_computed > num_local_computed {
            num_tokens += step.import_step_tokens;
            available -= step.reserved_import_pages as i64;
            size_import = Some(cdiv(num_tokens, cfg.block_size));
        }
    }
    let required =
        cfg.base_num_blocks_to_allocate(host, st, num_tokens, new_computed, total_computed, num_local_computed, false)?;
    let blocks = if required as i64 > available { device_num_blocks + 1 } else { 0 };
    Ok(SourceCount { blocks, size_import })
}

/// `HiSparseResidentManager.get_resident_page`: the GPU block of page `page` with the
/// residency overlay applied, None for a host-only (null) page or one past the table.
pub fn resident_page(st: &ReqState, overlay: Option<&BTreeMap<usize, u32>>, page: usize) -> Option<u32> {
    if !st.present {
        return None;
    }
    let mut block = *st.blocks.get(page)?;
    if let Some(b) = overlay.and_then(|o| o.get(&page)) {
        block = *b;
    }
    (block != NULL_BLOCK).then_some(block)
}

/// `HiSparseResidentManager.get_residency_row(request, start)`: the table from `start` with
/// the overlay applied (host-only pages stay the null block).
pub fn residency_row(st: &ReqState, overlay: Option<&BTreeMap<usize, u32>>, start: usize) -> Vec<u32> {
    let blocks: &[u32] = if st.present { &st.blocks } else { &[] };
    crate::hisparse::residency::overlaid_row(blocks, overlay, start)
}

/// `HiSparseResidentManager.get_num_blocks_to_allocate`. An external import
/// (`total_computed > num_local_computed`) keeps only its last page writable (one block if
/// that page is not resident) plus the pages past the import; otherwise host pages are not
/// allocated and `apply_admission_cap` caps the count at `cfg.max_admission_blocks`.
#[allow(clippy::too_many_arguments)] // vLLM's signature plus the overlay
pub fn resident_num_blocks_to_allocate(
    cfg: &TypeConfig,
    st: &ReqState,
    overlay: Option<&BTreeMap<usize, u32>>,
    num_tokens: usize,
    total_computed: usize,
    num_local_computed: usize,
    apply_admission_cap: bool,
) -> usize {
    let existing = if st.present { st.blocks.len() } else { 0 };
    if total_computed > num_local_computed {
        let imported_pages = cdiv(total_computed, cfg.block_size);
        let needs_tail = resident_page(st, overlay, imported_pages - 1).is_none();
        return needs_tail as usize + cdiv(num_tokens, cfg.block_size).saturating_sub(imported_pages.max(existing));
    }
    let host_pages = cdiv(num_local_computed, cfg.block_size);
    let mut required = cdiv(num_tokens, cfg.block_size);
    if apply_admission_cap {
        if let Some(cap) = cfg.max_admission_blocks {
            required = required.min(cap);
        }
    }
    required.saturating_sub(existing.max(host_pages))
}

/// Blocks [`resident_allocate_external_computed_blocks`] would take (0 or 1).
pub fn resident_external_blocks_needed(
    cfg: &TypeConfig,
    st: &ReqState,
    overlay: Option<&BTreeMap<usize, u32>>,
    num_local_computed: usize,
    num_external: usize,
) -> usize {
    if num_external == 0 {
        return 0;
    }
    let tail_page = (num_local_computed + num_external - 1) / cfg.block_size;
    resident_page(st, overlay, tail_page).is_none() as usize
}

/// `HiSparseResidentManager.allocate_external_computed_blocks`: pad the table with null
/// (host-only) pages up to the import's last page and give that page a writable block.
/// Errors: `num_external == 0` (vLLM asserts), the device pool out of blocks.
pub fn resident_allocate_external_computed_blocks(
    cfg: &TypeConfig,
    pool: &mut BlockPool,
    st: &mut ReqState,
    overlay: Option<&BTreeMap<usize, u32>>,
    num_local_computed: usize,
    num_external: usize,
) -> Result<()> {
    if num_external == 0 {
        return Err(crate::error::Error::Assertion(
            "HiSparseResidentManager.allocate_external_computed_blocks needs external tokens".into(),
        ));
    }
    let tail_page = (num_local_computed + num_external - 1) / cfg.block_size;
    let needs_block = resident_page(st, overlay, tail_page).is_none();
    if needs_block {
        let mut got = Vec::with_capacity(1);
        pool.get_new_blocks(1, &mut got)?;
        let blocks = st.table();
        if blocks.len() <= tail_page {
            blocks.resize(tail_page + 1, NULL_BLOCK);
        }
        blocks[tail_page] = got[0];
    } else {
        let blocks = st.table();
        if blocks.len() <= tail_page {
            blocks.resize(tail_page + 1, NULL_BLOCK);
        }
    }
    Ok(())
}

/// `HiSparseResidentManager.add_local_computed_blocks`: a host-prefix hit of
/// `num_local_computed` tokens becomes that many null (host-only) pages; the request is
/// running (`num_cached_block = 0`). Returns the host pages, for the coordinator's
/// `commit_computed_blocks(request, pages)` that follows. Errors: the request already has
/// blocks (vLLM asserts).
pub fn resident_add_local_computed_blocks(
    cfg: &TypeConfig,
    st: &mut ReqState,
    num_local_computed: usize,
) -> Result<usize> {
    if st.present && !st.blocks.is_empty() {
        return Err(crate::error::Error::Assertion("add_local_computed_blocks: the request already has blocks".into()));
    }
    let pages = cdiv(num_local_computed, cfg.block_size);
    st.table().resize(pages, NULL_BLOCK);
    st.num_cached = Some(0);
    Ok(pages)
}

/// `allocate_new_blocks` of the resident group: blocks up to `num_tokens`, never recorded
/// for zeroing (vLLM's override does not call the base). Errors: the device pool out of
/// blocks (the table unchanged).
pub fn resident_allocate_new_blocks(
    cfg: &TypeConfig,
    pool: &mut BlockPool,
    st: &mut ReqState,
    num_tokens: usize,
) -> Result<Vec<u32>> {
    let have = if st.present { st.blocks.len() } else { 0 };
    let n = cdiv(num_tokens, cfg.block_size).saturating_sub(have);
    let mut out = Vec::with_capacity(n);
    if n > 0 {
        pool.get_new_blocks(n, &mut out)?;
    }
    st.table().extend_from_slice(&out);
    Ok(out)
}

/// `HiSparseResidentManager.pop_blocks_for_free`, after the coordinator's `free(request)`:
/// the residency row (overlay applied; the caller then forgets the overlay), with its null
/// head trimmed when `trim_null_head` (0.33 and 0.34; 0.32 returns it whole). The request
/// is forgotten.
pub fn resident_pop_blocks_for_free(
    st: &mut ReqState,
    overlay: Option<&BTreeMap<usize, u32>>,
    trim_null_head: bool,
) -> Vec<u32> {
    let row = residency_row(st, overlay, 0);
    st.blocks.clear();
    st.present = false;
    st.num_cached = None;
    st.partial_hit = None;
    if trim_null_head {
        let lead = row.iter().take_while(|&&b| b == NULL_BLOCK).count();
        row[lead..].to_vec()
    } else {
        row
    }
}

/// `HiSparseHotManager.get_num_blocks_to_allocate`: the missing part of the hot region
/// (`blocks_per_request` blocks) when the request reads host-backed history: an external
/// import, a new request resuming a host prefix, or one in `hot_required`; otherwise 0.
pub fn hot_num_blocks_to_allocate(
    st: &ReqState,
    blocks_per_request: usize,
    hot_required: bool,
    total_computed: usize,
    num_local_computed: usize,
) -> usize {
    let host_import = total_computed > num_local_computed;
    let resumes_host_prefix = num_local_computed > 0 && st.num_cached.is_none();
    if host_import || resumes_host_prefix || hot_required {
        hot_num_required_blocks(st, blocks_per_request)
    } else {
        0
    }
}

/// `HiSparseHotManager.get_num_required_blocks`.
pub fn hot_num_required_blocks(st: &ReqState, blocks_per_request: usize) -> usize {
    let have = if st.present { st.blocks.len() } else { 0 };
    blocks_per_request.saturating_sub(have)
}

/// `HiSparseHotManager.has_hot`.
pub fn hot_has_hot(st: &ReqState, blocks_per_request: usize) -> bool {
    let have = if st.present { st.blocks.len() } else { 0 };
    have == blocks_per_request
}

/// `HiSparseHotManager.add_local_computed_blocks`: the request is running
/// (`num_cached_block = 0`). Returns whether the coordinator's `require_hot(request)`
/// follows: a host-prefix hit, or no resident group at all.
pub fn hot_add_local_computed_blocks(st: &mut ReqState, num_local_computed: usize, has_resident_groups: bool) -> bool {
    st.num_cached = Some(0);
    num_local_computed > 0 || !has_resident_groups
}

/// `HiSparseHotManager.allocate_new_blocks`: the request is running; if it is in
/// `hot_required`, the hot region is filled up to `blocks_per_request` blocks. Errors: the
/// device pool out of blocks (the table unchanged).
pub fn hot_allocate_new_blocks(
    pool: &mut BlockPool,
    st: &mut ReqState,
    blocks_per_request: usize,
    hot_required: bool,
) -> Result<Vec<u32>> {
    st.num_cached = Some(0);
    if !hot_required {
        return Ok(Vec::new());
    }
    let have = if st.present { st.blocks.len() } else { 0 };
    let n = blocks_per_request.saturating_sub(have);
    let mut out = Vec::with_capacity(n);
    if n > 0 {
        pool.get_new_blocks(n, &mut out)?;
    }
    st.table().extend_from_slice(&out);
    Ok(out)
}

#[cfg(test)]
#[path = "hisparse_tests.rs"]
mod tests;
