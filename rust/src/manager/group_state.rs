//! The data of one KV-cache group that the coordinator and every group kind share: a
//! request's state in the group ([`ReqState`]), what the group is ([`TypeConfig`]), its
//! per-request table ([`TypeState`], [`TypeManager`]), and the inputs and result of a
//! prefix-hit search ([`HitQuery`], [`Hit`]). The behaviour lives in
//! [`super::single_type`] (what every kind shares) and in the files named after the kinds.

use crate::error::{Error, Result};
use crate::hashing::source::{HashSource, ScaledHashes};
use crate::manager::hit_verify::VerifyCtx;
use crate::manager::release::ReleaseRules;
use crate::manager::spec::GroupSpec;
use crate::pool::cache_map::Key;
use hashbrown::HashSet;

/// One request's state in one group.
///
/// Laid out for the calls vLLM's scheduler makes for every running request every step: what
/// their no-op checks read (`present`, `num_cached`, `blocks`, whether `partial_hit` is set)
/// comes first, and the state starts on a cache-line boundary, so those checks read one line
/// (see [`ReqState::HOT_BYTES`]); the Mamba bookkeeping follows.
#[derive(Clone, Debug, Default)]
#[repr(C, align(64))]
pub struct ReqState {
    /// The request has an entry in `req_to_blocks` (possibly empty).
    pub present: bool,
    /// Member of `_allocated_block_reqs` (Mamba "align").
    pub allocated: bool,
    /// `_partial_hit_reqs[request_id]`: (block index, source block) of a partial hit's tail,
    /// to be replaced by a private copy.
    pub partial_hit: Option<(u32, u32)>,
    /// `num_cached_block[request_id]` (present for running requests only).
    pub num_cached: Option<usize>,
    /// `req_to_blocks[request_id]`: the block table, null blocks where positions were skipped.
    pub blocks: Vec<u32>,
    // Mamba "align" bookkeeping.
    /// `last_state_block_idx`.
    pub last_state_block_idx: Option<i64>,
    /// `_num_retired_blocks`.
    pub num_retired: Option<usize>,
    /// `_checkpoints`: (checkpoint position, reserved block index).
    pub checkpoint: Option<(usize, usize)>,
    /// `_producer_partial_tail_reqs`: (source block, boundary tokens).
    pub producer_tail: Option<(u32, usize)>,
}

impl ReqState {
    /// The leading bytes that hold what a no-op check reads (one cache line).
    pub const HOT_BYTES: usize = 64;

    /// True when nothing of the request is left in this group.
    pub fn is_vacant(&self) -> bool {
        !self.present
            && self.num_cached.is_none()
            && self.partial_hit.is_none()
            && self.last_state_block_idx.is_none()
            && self.num_retired.is_none()
            && !self.allocated
            && self.checkpoint.is_none()
            && self.producer_tail.is_none()
    }

    /// True if the request has a non-empty table (vLLM's `self.req_to_blocks.get(id)` is
    /// truthy).
    #[inline]
    pub fn has_blocks(&self) -> bool {
        self.present && !self.blocks.is_empty()
    }

    /// `self.req_to_blocks[request_id]` (defaultdict access).
    #[inline]
    pub fn table(&mut self) -> &mut Vec<u32> {
        self.present = true;
        &mut self.blocks
    }
}

/// What the managers read from a request besides its hashes.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReqInfo<'a> {
    pub request_id: &'a str,
    pub num_prompt_tokens: usize,
    pub num_computed_tokens: usize,
    pub num_tokens: usize,
    pub shared_prefix_boundary: usize,
    /// Caller's handle for the KV events of this request.
    pub event_tag: u64,
}

/// The fixed configuration of one group's manager.
#[derive(Clone, Debug)]
pub struct TypeConfig {
    pub spec: GroupSpec,
    pub group_id: u32,
    /// Tokens per block (the spec's, times the DCP world size for a sharded spec).
    pub block_size: usize,
    pub dcp_world_size: usize,
    pub pcp_world_size: usize,
    pub scheduler_block_size: usize,
    /// The alignment of hits (the coordinator lowers it for fine-grained hybrid lookups).
    pub cache_hit_alignment_tokens: usize,
    pub enable_caching: bool,
    pub max_admission_blocks: Option<usize>,
    pub record_new_block_ids: bool,
    /// The group drops the EAGLE block on hits (set by the coordinator).
    pub use_eagle: bool,
    /// Mamba: `shared_prefix_checkpoint`.
    pub shared_prefix_checkpoint: bool,
    /// Mamba: `drop_eagle_checkpoint_block`.
    pub drop_eagle_checkpoint_block: bool,
    /// The installed vLLM release's rules where releases differ.
    pub rules: ReleaseRules,
}

/// The mutable per-group state that is not per request.
#[derive(Clone, Debug, Default)]
pub struct TypeState {
    /// Block ids allocated since the last `take_new_block_ids` (for zeroing).
    pub new_block_ids: Vec<u32>,
    /// `_pending_cow_copies`: (source, copy) pairs.
    pub pending_cow: Vec<(u32, u32)>,
    /// `_pending_boundary_state_offloads`: (request id, group, block, boundary tokens).
    pub pending_offloads: Vec<(String, u32, u32, usize)>,
    /// Mamba: `cached_blocks_this_step`.
    pub cached_this_step: HashSet<Key>,
}

/// The manager of one group: configuration, group state and per-request states by slot.
#[derive(Clone, Debug)]
pub struct TypeManager {
    pub cfg: TypeConfig,
    pub st: TypeState,
    pub reqs: Vec<ReqState>,
}

/// A hit lookup (vLLM's `find_longest_cache_hit` arguments).
#[derive(Clone, Copy)]
pub struct HitQuery<'a> {
    /// The request's hashes at the hash block size.
    pub hashes: &'a dyn HashSource,
    pub max_length: usize,
    pub group_ids: &'a [u32],
    pub drop_eagle_block: bool,
    pub alignment_tokens: usize,
    /// A lookup past the request's hashes is vLLM's `IndexError` (vLLM's callers), not a
    /// miss (kvblock's own API).
    pub past_hashes_is_error: bool,
    /// Verify on hit ([`crate::manager::hit_verify`]): full-attention lookups check every
    /// block they find against the request's content (None: no verification).
    pub verify: Option<VerifyCtx<'a>>,
}

impl HitQuery<'_> {
    /// Whether block `i` of `hashes` can be looked up: false past the end for kvblock's own
    /// API (a miss), an `IndexError` for vLLM's callers, as vLLM's sliding-window, chunked
    /// local and Mamba finders index the hash list up to `max_length` (a request hashed with
    /// lookahead tokens holds fewer hashes than its tokens).
    pub fn in_hashes(&self, i: usize, len: usize) -> Result<bool> {
        if i < len {
            Ok(true)
        } else if self.past_hashes_is_error {
            Err(Error::Index("list index out of range".into()))
        } else {
            Ok(false)
        }
    }
}

/// Blocks of a hit, one list per group of the lookup, and the hit length in tokens.
pub type Hit = (Vec<Vec<u32>>, usize);

/// `resolve_block_hashes`: the request's hashes viewed at `block_size`, or raw when equal or
/// for a fine-grained lookup.
pub fn resolve_block_hashes<'a>(
    hashes: &'a dyn HashSource,
    hash_block_size: usize,
    block_size: usize,
    fine_grained: bool,
    alignment_tokens: Option<usize>,
) -> Result<ScaledHashes<'a>> {
    if block_size == hash_block_size {
        return Ok(ScaledHashes::raw(hashes));
    }
    if let Some(a) = alignment_tokens {
        if fine_grained && a < block_size && block_size.is_multiple_of(a) {
            return Ok(ScaledHashes::raw(hashes));
        }
    }
    ScaledHashes::new(hashes, hash_block_size, block_size)
}

/// A position in a block table, as [`ReqState::partial_hit`] keeps it. A table's positions
/// are bounded by the blocks and null padding it holds, far below `u32::MAX`; a larger index
/// saturates (it then names no position, and the checks that read it refuse it).
#[inline(always)]
pub(crate) fn table_index(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

#[inline(always)]
pub(crate) fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

#[cfg(test)]
mod tests {
    use super::ReqState;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn a_no_op_check_reads_one_cache_line() {
        assert_eq!(align_of::<ReqState>(), ReqState::HOT_BYTES);
        assert_eq!(size_of::<ReqState>() % ReqState::HOT_BYTES, 0);
        for end in [
            offset_of!(ReqState, present) + 1,
            offset_of!(ReqState, num_cached) + size_of::<Option<usize>>(),
            offset_of!(ReqState, blocks) + size_of::<Vec<u32>>(),
            offset_of!(ReqState, partial_hit) + size_of::<Option<(u32, u32)>>(),
        ] {
            assert!(end <= ReqState::HOT_BYTES, "{end}");
        }
    }
}
