//! Chunked local attention (vLLM's `ChunkedLocalAttentionManager`): tokens attend within
//! their chunk only, so blocks before the current chunk count as computed (null blocks) and
//! a hit is the run of cached blocks from the chunk start (spec §6.2).

use crate::error::{Error, Result};
use crate::hashing::source::HashSource;
use crate::manager::group_state::{resolve_block_hashes, Hit, HitQuery, TypeConfig};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};

/// `ChunkedLocalAttentionManager.find_longest_cache_hit`.
pub fn find_longest_cache_hit(cfg: &TypeConfig, chunk: usize, pool: &BlockPool, q: &HitQuery<'_>) -> Result<Hit> {
    if q.drop_eagle_block {
        return Err(Error::Assertion("Hybrid KV cache is not supported for eagle + chunked local attention.".into()));
    }
    let block_size = cfg.spec.block_size;
    if block_size != q.alignment_tokens {
        return Err(Error::Assertion(
            "KV cache groups with different block sizes are not compatible with chunked local attention now".into(),
        ));
    }
    let hashes = resolve_block_hashes(q.hashes, pool.hash_block_size(), block_size, false, Some(q.alignment_tokens))?;
    let max_blocks = q.max_length / block_size;
    let start = if q.max_length > 0 { q.max_length / chunk * chunk } else { 0 };
    let start_block = start / block_size;
    let mut computed: Vec<Vec<u32>> = vec![vec![NULL_BLOCK; start_block]; q.group_ids.len()];
    let mut hit = Vec::with_capacity(q.group_ids.len());
    for i in start_block..max_blocks {
        if !q.in_hashes(i, hashes.len())? || !pool.get_cached_block(hashes.get(i)?, q.group_ids, &mut hit) {
            break;
        }
        for (c, &b) in computed.iter_mut().zip(&hit) {
            c.push(b);
        }
    }
    let len = computed[0].len() * block_size;
    Ok((computed, len))
}
