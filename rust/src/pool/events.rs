//! KV cache events as the block pool emits them (spec §8): `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`, buffered in order and drained in batches.
//!
//! A `BlockStored` here carries what the pool knows (hashes, parent, token ranges, block size,
//! group). The request-derived fields (token ids, extra keys, LoRA, lookahead tokens) are
//! added by the caller, which passes an opaque `tag` to find the request again.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::hashing::Digest;

/// Where an event's blocks live: the pool's own medium (the device: vLLM's `medium` "GPU"), or a
/// host pool whose events share the device pool's queue (HiSparse's host tier: "CPU").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Medium {
    #[default]
    Device,
    Host,
}

/// The order of events across pools that share one queue: every stamped event takes the next
/// tick, so merging two pools' queues by tick gives the order the events were recorded in.
static EVENT_CLOCK: AtomicU64 = AtomicU64::new(0);

/// The next tick of the process-wide event clock.
pub fn next_tick() -> u64 {
    EVENT_CLOCK.fetch_add(1, Ordering::Relaxed)
}

/// One KV cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Blocks were cached: one event per `cache_full_blocks`, `cache_partial_block` or
    /// `emit_cached_block_events` call.
    BlockStored {
        /// New block hashes, in block order (null and masked-out blocks have none).
        block_hashes: Vec<Digest>,
        /// Hash of the block before the first one (from the request's hashes), if any.
        parent_block_hash: Option<Digest>,
        /// The event's token ids are `all_token_ids[token_start..token_end]` (null blocks of
        /// the range included, as vLLM's are).
        token_start: usize,
        token_end: usize,
        /// The event's `block_size`.
        block_size: usize,
        /// KV-cache group.
        group: u32,
        /// Token range `[start, end)` of each block in `block_hashes`: its extra keys (and,
        /// with lookahead hashing, its lookahead tokens) come from there.
        key_ranges: Vec<(usize, usize)>,
        /// Caller-defined handle of the request the blocks belong to.
        tag: u64,
        /// The pool's medium.
        medium: Medium,
    },
    /// A cached block lost a key (eviction): one event per key.
    BlockRemoved {
        /// The removed hash.
        block_hash: Digest,
        /// Its group (from the key).
        group: u32,
        /// The pool's medium.
        medium: Medium,
    },
    /// `reset_prefix_cache` cleared every key.
    AllBlocksCleared,
}
