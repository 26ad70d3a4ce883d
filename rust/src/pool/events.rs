//! KV cache events as the block pool emits them (spec §8): `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`, buffered in order and drained in batches.
//!
//! A `BlockStored` here carries what the pool knows (hashes, parent, the block range and size,
//! the group). The request-derived fields (token ids, extra keys, LoRA) are added by the
//! caller, which passes an opaque `tag` to find the request again.

use crate::hashing::Digest;

/// One KV cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Full blocks were cached: one event per `cache_full_blocks` call.
    BlockStored {
        /// New block hashes, in block order.
        block_hashes: Vec<Digest>,
        /// Hash of the block before the first one (from the request's hashes), if any.
        parent_block_hash: Option<Digest>,
        /// Index of the first block of the range in the request's table (`num_cached_blocks`).
        first_block: usize,
        /// Blocks in the range (`num_full_blocks - num_cached_blocks`); the event's token ids
        /// cover all of them, null ones included (as vLLM's do).
        num_blocks: usize,
        /// Offsets in the range of the null blocks that were skipped (sliding window), in
        /// order; `block_hashes` holds one hash per other block.
        null_offsets: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// KV-cache group.
        group: u32,
        /// Caller-defined handle of the request the blocks belong to.
        tag: u64,
    },
    /// A cached block lost its key (eviction): one event per key.
    BlockRemoved {
        /// The removed hash.
        block_hash: Digest,
        /// Its group (from the key).
        group: u32,
    },
    /// `reset_prefix_cache` cleared every key.
    AllBlocksCleared,
}
