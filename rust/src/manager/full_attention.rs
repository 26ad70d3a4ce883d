//! Full attention (vLLM's `FullAttentionManager`, and its `RSWAManager`,
//! `SinkFullAttentionManager` and `CircularBufferManager` variants): every block is kept;
//! hits are the longest run of cached blocks from the start, extended inside the next block
//! at hash-block granularity when the hybrid lookup is fine-grained (spec §6.2).

use crate::error::{Error, Result};
use crate::hashing::source::{HashSource, ScaledHashes};
use crate::manager::group_state::{
    cdiv, resolve_block_hashes, Hit, HitQuery, ReqInfo, ReqState, TypeConfig, TypeState,
};
use crate::manager::hit_verify::ROOT;
use crate::pool::block_pool::BlockPool;

/// `FullAttentionManager.find_longest_cache_hit`.
pub fn find_longest_cache_hit(cfg: &TypeConfig, pool: &BlockPool, q: &HitQuery<'_>) -> Result<Hit> {
    let mut block_size = cfg.spec.block_size;
    if cfg.dcp_world_size > 1 {
        block_size *= cfg.dcp_world_size;
    }
    let h = pool.hash_block_size();
    let hashes = resolve_block_hashes(q.hashes, h, block_size, true, Some(q.alignment_tokens))?;
    let a = q.alignment_tokens;
    let fine_grained = a < block_size && block_size.is_multiple_of(a);
    let full: ScaledHashes<'_> = if fine_grained { ScaledHashes::new(hashes.fine(), a, block_size)? } else { hashes };
    let n_groups = q.group_ids.len();
    let mut computed: Vec<Vec<u32>> = vec![Vec::new(); n_groups];
    let mut hit = Vec::with_capacity(n_groups);
    // Phase 1: the longest run of cached full blocks from the start (a miss implies every
    // later block misses: the hashes are chained).
    let max_blocks = (q.max_length / block_size).min(full.len());
    // verify on hit: the content ids of the blocks that passed at the previous position
    let mut prev = if q.verify.is_some() { vec![ROOT; n_groups] } else { Vec::new() };
    if q.verify.is_some() && (fine_grained || block_size != h) {
        return Err(Error::Value("verify_hits: only full-attention blocks of the hash block size are verified".into()));
    }
    // a lookup reads each block's hash, rarely in cache (hashed when the request arrived):
    // start loading those a few blocks ahead, so that their misses overlap the lookups
    const AHEAD: usize = 8;
    for i in 0..AHEAD.min(max_blocks) {
        full.prefetch(i);
    }
    // and each block's table buckets half as far ahead, its hash having arrived by then
    const BUCKET_AHEAD: usize = AHEAD / 2;
    for i in 0..BUCKET_AHEAD.min(max_blocks) {
        pool.prefetch_lookup(full.get(i)?, q.group_ids);
    }
    for i in 0..max_blocks {
        if i + AHEAD < max_blocks {
            full.prefetch(i + AHEAD);
        }
        if i + BUCKET_AHEAD < max_blocks {
            pool.prefetch_lookup(full.get(i + BUCKET_AHEAD)?, q.group_ids);
        }
        if !pool.get_cached_block(full.get(i)?, q.group_ids, &mut hit) {
            break;
        }
        if let Some(v) = &q.verify {
            // a block that fails ends the hit there, as if its hash had not been found
            if !v.check(pool, i, &hit, &mut prev) {
                break;
            }
        }
        for (c, &b) in computed.iter_mut().zip(&hit) {
            c.push(b);
        }
    }
    let mut hit_length = computed[0].len() * block_size;
    // Phase 2 (fine-grained): extend into the next block, probing its interior boundaries
    // from the longest down.
    if fine_grained {
        let scale = block_size / a;
        let first = computed[0].len() * scale;
        let max_partial = (first + scale - 1).min(q.max_length / a).min(hashes.len());
        let mut i = max_partial;
        while i > first {
            i -= 1;
            if pool.get_cached_block(hashes.get(i)?, q.group_ids, &mut hit) {
                for (c, &b) in computed.iter_mut().zip(&hit) {
                    c.push(b);
                }
                hit_length = (i + 1) * a;
                break;
            }
        }
    }
    // EAGLE recomputes the tokens before the generation point: drop one hash unit when
    // fine-grained, else one block.
    if q.drop_eagle_block && hit_length > 0 {
        hit_length -= a.min(block_size).min(hit_length);
    }
    hit_length -= hit_length % a;
    let n = cdiv(hit_length, block_size);
    for c in &mut computed {
        c.truncate(n);
    }
    Ok((computed, hit_length))
}

/// `FullAttentionManager._cache_partial_tail_block`: when the prompt's last hash boundary
/// ends inside a block, key that block at the boundary too.
pub fn cache_partial_tail_block(
    cfg: &TypeConfig,
    pool: &mut BlockPool,
    st: &mut ReqState,
    req: &ReqInfo<'_>,
    hashes: &dyn HashSource,
    num_tokens: usize,
) -> Result<()> {
    let h = pool.hash_block_size();
    // a resend hits at most `prompt - 1` tokens; EAGLE lookups read the whole prompt first
    let limit = if cfg.use_eagle { req.num_prompt_tokens } else { req.num_prompt_tokens.saturating_sub(1) };
    let boundary = (limit / h).min(hashes.len()) * h;
    if boundary == 0 || boundary > num_tokens || boundary.is_multiple_of(cfg.block_size) {
        return Ok(());
    }
    let blocks = st.table();
    let idx = boundary / cfg.block_size;
    if idx >= blocks.len() {
        return Ok(());
    }
    let b = blocks[idx];
    pool.cache_partial_block(b, hashes, boundary, cfg.group_id, cfg.block_size, false, req.event_tag)?;
    Ok(())
}

/// `RSWAManager.remove_skipped_blocks`: with the prompt length known, free the gap between
/// the prompt's last block and the decode window; else the base behaviour (nothing to skip).
pub fn rswa_remove_skipped_blocks(
    cfg: &TypeConfig,
    window: usize,
    pool: &mut BlockPool,
    st: &mut ReqState,
    processed_computed_tokens: usize,
    num_prompt_tokens: Option<usize>,
) -> Result<()> {
    let Some(prompt) = num_prompt_tokens else {
        return cfg.base_remove_skipped_blocks(pool, st, processed_computed_tokens);
    };
    let bs = cfg.block_size;
    let first_gap = cdiv(prompt, bs);
    let window_start = prompt.max(processed_computed_tokens.saturating_sub(window));
    cfg.base_remove_blocks_in_range(pool, st, first_gap, window_start / bs)
}

/// `CircularBufferManager._claim_ring_block`: the request's one ring block, on first use.
pub fn claim_ring_block(
    cfg: &TypeConfig,
    pool: &mut BlockPool,
    ts: &mut TypeState,
    st: &mut ReqState,
    record_for_zeroing: bool,
) -> Result<Vec<u32>> {
    if !st.table().is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::with_capacity(1);
    pool.get_new_blocks(1, &mut out)?;
    st.blocks.extend_from_slice(&out);
    if cfg.record_new_block_ids && record_for_zeroing {
        ts.new_block_ids.extend_from_slice(&out);
    }
    Ok(out)
}
