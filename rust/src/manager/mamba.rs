//! Mamba / linear-attention state (vLLM's `MambaManager`, spec §6.2). A request needs only
//! the state after its last computed token. In "align" mode (prefix caching) states are kept
//! at block boundaries: a table holds null blocks where states were retired, the running
//! state, speculative blocks, optional prefill checkpoints, and copy-on-write copies of
//! partial-hit tails; a hit is the single last cached state block, found right to left.

use crate::error::{Error, Result};
use crate::hashing::source::HashSource;
use crate::manager::group_state::{
    cdiv, resolve_block_hashes, table_index, Hit, HitQuery, ReqInfo, ReqState, TypeConfig, TypeState,
};
use crate::manager::spec::{Kind, MambaMode};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};
use crate::pool::cache_map::Key;

/// Python's floor division.
#[inline]
fn floor_div(a: i64, b: i64) -> i64 {
    a.div_euclid(b)
}

/// Python's `cdiv` (`-(-a // b)`).
#[inline]
fn cdiv_i(a: i64, b: i64) -> i64 {
    -floor_div(-a, b)
}

struct MambaParams {
    mode: MambaMode,
    nsb: usize,
    num_prefill_checkpoint_blocks: usize,
    prefill_checkpoint_alignment: Option<usize>,
}

fn params(cfg: &TypeConfig) -> MambaParams {
    match cfg.spec.kind {
        Kind::Mamba { mode, num_speculative_blocks, num_prefill_checkpoint_blocks, prefill_checkpoint_alignment } => {
            MambaParams {
                mode,
                nsb: num_speculative_blocks,
                num_prefill_checkpoint_blocks,
                prefill_checkpoint_alignment,
            }
        }
        _ => MambaParams {
            mode: MambaMode::None,
            nsb: 0,
            num_prefill_checkpoint_blocks: 0,
            prefill_checkpoint_alignment: None,
        },
    }
}

/// `get_mamba_prefill_checkpoint_position`: the reusable checkpoint boundary of a prefill of
/// `num_tokens` tokens.
pub fn prefill_checkpoint_position(
    num_tokens: usize,
    hash_block_size: usize,
    drop_eagle_block: bool,
    lookahead: usize,
) -> usize {
    let h = hash_block_size as i64;
    let proof_limit = if drop_eagle_block { num_tokens as i64 } else { num_tokens as i64 - lookahead.max(1) as i64 };
    let mut pos = floor_div(proof_limit, h) * h;
    if drop_eagle_block {
        pos -= h;
    }
    pos.max(0) as usize
}

/// `is_mamba_prefill_checkpoint_valid`.
pub fn prefill_checkpoint_valid(
    query_start: usize,
    query_end: usize,
    position: usize,
    hash_block_size: usize,
    mamba_block_size: usize,
    alignment: Option<usize>,
) -> bool {
    let Some(alignment) = alignment else { return false };
    let (qs, qe, pos, h, m) =
        (query_start as i64, query_end as i64, position as i64, hash_block_size as i64, mamba_block_size as i64);
    let initial_state_col = floor_div(qs - 1, m);
    let checkpoint_col = cdiv_i(qe, m) - 2;
    qs % h == 0
        && checkpoint_col > initial_state_col
        && qs + h <= pos
        && qs < pos
        && pos < qe
        && (pos - qs) % alignment as i64 == 0
}

/// `MambaManager.find_longest_cache_hit`.
pub fn find_longest_cache_hit(cfg: &TypeConfig, pool: &BlockPool, q: &HitQuery<'_>) -> Result<Hit> {
    let block_size = cfg.spec.block_size;
    let a = q.alignment_tokens;
    let hashes = resolve_block_hashes(q.hashes, pool.hash_block_size(), block_size, true, Some(a))?;
    let n_groups = q.group_ids.len();
    let mut computed: Vec<Vec<u32>> = vec![Vec::new(); n_groups];
    let mut hit = Vec::with_capacity(n_groups);
    if a < block_size && block_size.is_multiple_of(a) {
        let scale = block_size / a;
        let max_units = (q.max_length / a).min(hashes.len());
        let mut i = max_units;
        while i > 0 {
            i -= 1;
            if pool.get_cached_block(hashes.get(i)?, q.group_ids, &mut hit) {
                let block_idx = i / scale;
                for (c, &b) in computed.iter_mut().zip(&hit) {
                    c.extend(std::iter::repeat_n(NULL_BLOCK, block_idx));
                    c.push(b);
                }
                return Ok((computed, (i + 1) * a));
            }
        }
        return Ok((computed, 0));
    }
    let max_blocks = q.max_length / block_size;
    let mut i = max_blocks;
    while i > 0 {
        i -= 1;
        if q.in_hashes(i, hashes.len())? && pool.get_cached_block(hashes.get(i)?, q.group_ids, &mut hit) {
            if block_size != a && !((i + 1) * block_size).is_multiple_of(a) {
                continue;
            }
            for (c, &b) in computed.iter_mut().zip(&hit) {
                c.extend(std::iter::repeat_n(NULL_BLOCK, i));
                c.push(b);
            }
            return Ok((computed, (i + 1) * block_size));
        }
    }
    Ok((computed, 0))
}

/// `MambaManager.reachable_block_mask`: sparse state retention (None: every block).
pub fn reachable_block_mask(
    block_size: usize,
    start_block: usize,
    end_block: usize,
    alignment_tokens: Option<usize>,
    retention_interval: Option<usize>,
    reachable_boundaries: &[usize],
) -> Option<Vec<bool>> {
    let r = retention_interval?;
    let a = alignment_tokens?;
    let mut mask = vec![false; end_block - start_block];
    if r != 0 {
        let per_segment = r / block_size;
        if per_segment <= 1 {
            return None;
        }
        let first_boundary = (start_block + per_segment) / per_segment * per_segment - 1;
        let mut i = first_boundary - start_block;
        while i < mask.len() {
            mask[i] = true;
            i += per_segment;
        }
    }
    for &boundary in reachable_boundaries {
        let aligned = boundary / a * a;
        let bb = (aligned / block_size) as i64 - 1;
        if bb >= start_block as i64 && (bb as usize) < end_block {
            mask[bb as usize - start_block] = true;
        }
    }
    Some(mask)
}

/// `MambaManager._remove_blocks_in_range` in "align" mode: null and free the states of
/// `[first, last)`, crossing null gaps, from the first not yet retired.
pub fn remove_blocks_in_range(pool: &mut BlockPool, st: &mut ReqState, first: usize, last: usize) -> Result<()> {
    let first = first.max(st.num_retired.unwrap_or(0));
    let last = if st.present { last.min(st.blocks.len()) } else { 0 };
    if first >= last {
        return Ok(());
    }
    let freed: Vec<u32> = (first..last).rev().map(|i| st.blocks[i]).filter(|&b| b != NULL_BLOCK).collect();
    if !freed.is_empty() {
        pool.free_blocks(&freed, true)?;
        for b in &mut st.blocks[first..last] {
            *b = NULL_BLOCK;
        }
    }
    st.num_retired = Some(last);
    Ok(())
}

/// `MambaManager.remove_skipped_blocks`.
pub fn remove_skipped_blocks(
    cfg: &TypeConfig,
    pool: &mut BlockPool,
    st: &mut ReqState,
    processed: usize,
) -> Result<()> {
    cfg.base_remove_skipped_blocks(pool, st, processed)?;
    if !cfg.is_mamba_align() {
        return Ok(());
    }
    // the state block allocated two steps ago is no longer needed
    if let Some(last) = st.last_state_block_idx {
        if last < cdiv_i(processed as i64, cfg.block_size as i64) - 1 {
            let blocks = st.table();
            let idx = if last < 0 { blocks.len() as i64 + last } else { last };
            if idx < 0 || idx as usize >= blocks.len() {
                return Err(Error::Assertion(format!("last state block index {last} is outside the table")));
            }
            let b = blocks[idx as usize];
            if b != NULL_BLOCK {
                pool.free_blocks(&[b], true)?;
                st.blocks[idx as usize] = NULL_BLOCK;
            }
        }
    }
    Ok(())
}

/// `_needs_internal_checkpoint`.
#[allow(clippy::too_many_arguments)] // vLLM's signature
fn needs_internal_checkpoint(
    cfg: &TypeConfig,
    p: &MambaParams,
    pool: &BlockPool,
    st: &mut ReqState,
    query_start: usize,
    query_end: usize,
    position: usize,
    prefill_end: usize,
) -> bool {
    let checkpoint_idx = cdiv_i(query_end as i64, cfg.block_size as i64) - 2;
    let blocks = st.table();
    let has_checkpoint_blocks = p.mode == MambaMode::Align && p.num_prefill_checkpoint_blocks > 0;
    has_checkpoint_blocks
        && query_end >= prefill_end
        && prefill_checkpoint_valid(
            query_start,
            query_end,
            position,
            pool.hash_block_size(),
            cfg.block_size,
            p.prefill_checkpoint_alignment,
        )
        && checkpoint_idx >= 0
        && (checkpoint_idx as usize >= blocks.len()
            || blocks[checkpoint_idx as usize] == NULL_BLOCK
            || (st.allocated && checkpoint_idx >= st.blocks.len() as i64 - p.nsb as i64))
}

/// `MambaManager.get_num_blocks_to_allocate` (may be negative in "align" mode, as vLLM's).
#[allow(clippy::too_many_arguments)] // vLLM's signature
pub fn get_num_blocks_to_allocate(
    cfg: &TypeConfig,
    ts: &mut TypeState,
    pool: &BlockPool,
    st: &mut ReqState,
    num_tokens: usize,
    new_computed: &[u32],
    total_computed: usize,
    num_local_computed: usize,
    num_tokens_main_model: usize,
    apply_admission_cap: bool,
    prefill_end: usize,
) -> Result<i64> {
    let p = params(cfg);
    if let Some(&last) = new_computed.last() {
        if let Some(key) = pool.block_key(last)? {
            if ts.cached_this_step.contains(&key) {
                // a state cached by another request this step is not usable yet
                return Ok(pool.num_blocks() as i64 + 1);
            }
        }
    }
    if p.mode != MambaMode::Align {
        let num_tokens = num_tokens + cfg.spec.block_size * p.nsb;
        return cfg
            .base_num_blocks_to_allocate(
                pool,
                st,
                num_tokens,
                new_computed,
                total_computed,
                num_local_computed,
                apply_admission_cap,
            )
            .map(|n| n as i64);
    }
    let num_tokens = num_tokens_main_model;
    let required = (cdiv(num_tokens, cfg.block_size) + p.nsb) as i64;
    let mut num_new = required - new_computed.len() as i64 - st.table().len() as i64;
    let has_partial_hit = cfg.has_partial_local_hit(new_computed, num_local_computed) || st.partial_hit.is_some();
    if has_partial_hit {
        num_new = num_new.max(0) + 1;
    }
    let mut position = prefill_checkpoint_position(
        num_tokens,
        cfg.cache_hit_alignment_tokens,
        cfg.drop_eagle_checkpoint_block,
        pool.num_hash_lookahead_tokens(),
    );
    if !needs_internal_checkpoint(cfg, &p, pool, st, total_computed, num_tokens, position, prefill_end) {
        position = 0;
    }
    let checkpoint_block = (position > 0) as i64;
    if !apply_admission_cap {
        if position > 0 {
            let idx = cdiv(num_tokens, cfg.block_size) - 2;
            st.checkpoint = Some((position, idx));
        } else {
            st.checkpoint = None;
        }
    }
    if num_new > 0 {
        let mut cap = 1 + has_partial_hit as i64 + checkpoint_block;
        if !st.allocated {
            cap += p.nsb as i64;
        }
        num_new = num_new.min(cap);
    }
    Ok(num_new + TypeConfig::num_evictable(pool, new_computed) as i64)
}

/// The table length `allocate_new_blocks` reaches before taking new blocks in "align" mode
/// (null padding and speculative-block relocation), and whether it returns early.
fn align_len_before_new(cfg: &TypeConfig, p: &MambaParams, st: &ReqState, num_tokens: usize) -> (usize, usize, bool) {
    let prev = if st.present { st.blocks.len() } else { 0 };
    let required = cdiv(num_tokens, cfg.block_size) + p.nsb;
    let checkpoint_block = st.checkpoint.is_some() as usize;
    if required <= prev && st.partial_hit.is_none() && checkpoint_block == 0 {
        return (prev, required, true);
    }
    let skipped = (required as i64) - p.nsb as i64 - 1;
    let mut len = prev as i64;
    if (prev as i64) < skipped {
        let null_end = skipped - checkpoint_block as i64;
        len = len.max(null_end);
    }
    if st.allocated {
        let lo = prev as i64 - p.nsb as i64;
        let hi = (prev as i64).min(skipped - checkpoint_block as i64);
        len += (hi - lo).max(0);
    }
    (len.max(0) as usize, required, false)
}

/// Blocks `allocate_new_blocks` takes.
pub fn new_blocks_needed(cfg: &TypeConfig, st: &ReqState, num_tokens: usize, num_tokens_main_model: usize) -> usize {
    let p = params(cfg);
    if p.mode != MambaMode::Align {
        return cfg.new_blocks_needed(st, num_tokens + cfg.block_size * p.nsb);
    }
    let (len, required, early) = align_len_before_new(cfg, &p, st, num_tokens_main_model);
    if early {
        return 0;
    }
    required.saturating_sub(len) + st.partial_hit.is_some() as usize
}

/// `MambaManager.allocate_new_blocks`.
pub fn allocate_new_blocks(
    cfg: &TypeConfig,
    ts: &mut TypeState,
    pool: &mut BlockPool,
    st: &mut ReqState,
    request_id: &str,
    num_tokens: usize,
    num_tokens_main_model: usize,
) -> Result<Vec<u32>> {
    let p = params(cfg);
    if p.mode != MambaMode::Align {
        return cfg.base_allocate_new_blocks(pool, ts, st, num_tokens + cfg.block_size * p.nsb);
    }
    let num_tokens = num_tokens_main_model;
    st.table();
    let required = cdiv(num_tokens, cfg.block_size) + p.nsb;
    let checkpoint_block = st.checkpoint.is_some() as usize;
    let partial_hit = st.partial_hit;
    if required <= st.blocks.len() && partial_hit.is_none() && checkpoint_block == 0 {
        st.allocated = true;
        return Ok(Vec::new());
    }
    let prev = st.blocks.len();
    let blocks_allocated = st.allocated;
    if blocks_allocated {
        st.last_state_block_idx = Some(prev as i64 - 1 - p.nsb as i64);
    } else if prev > 0 {
        st.last_state_block_idx = Some(prev as i64 - 1);
    }
    let skipped = required as i64 - p.nsb as i64 - 1;
    if (prev as i64) < skipped {
        let null_end = skipped - checkpoint_block as i64;
        if null_end > prev as i64 {
            st.blocks.extend(std::iter::repeat_n(NULL_BLOCK, null_end as usize - prev));
        }
    }
    if blocks_allocated {
        let lo = prev as i64 - p.nsb as i64;
        for idx in lo..prev as i64 {
            if idx < skipped - checkpoint_block as i64 {
                relocate_speculative_block(pool, &mut st.blocks, idx)?;
            } else {
                break;
            }
        }
    }
    let mut num_new = required.saturating_sub(st.blocks.len());
    if partial_hit.is_some() {
        num_new += 1;
    }
    let mut max_new = 1 + partial_hit.is_some() as usize + checkpoint_block;
    if !blocks_allocated {
        max_new += p.nsb;
    }
    if num_new > max_new {
        return Err(Error::Assertion(format!("Mamba allocation of {num_new} blocks exceeds its cap of {max_new}")));
    }
    let mut new_blocks = Vec::with_capacity(num_new);
    pool.get_new_blocks(num_new, &mut new_blocks)?;
    let mut returned: Vec<u32> = st.blocks[prev..].to_vec();
    if let Some((block_idx, source)) = partial_hit {
        let block_idx = block_idx as usize;
        let cow = new_blocks.remove(0);
        if blocks_allocated {
            // a running request's worker table is append-only: it stays on `source`, and the
            // cache entry moves to `cow`, which the queued copy fills
            if st.blocks.get(block_idx) != Some(&source) {
                return Err(Error::Assertion("the partial-hit source block is not in place".into()));
            }
            pool.move_block_hashes(source, cow)?;
            ts.pending_cow.push((source, cow));
            pool.set_ref_cnt(source, pool.ref_of(source) + 1)?;
            if let Some((marker, boundary)) = st.producer_tail.take() {
                if marker != source {
                    return Err(Error::Assertion("the producer's partial tail is not the CoW source".into()));
                }
                ts.pending_offloads.push((request_id.to_string(), cfg.group_id, cow, boundary));
            }
            if let Some(key) = pool.block_key(cow)? {
                ts.cached_this_step.insert(key);
            }
        } else {
            cfg.apply_cow(pool, ts, st, block_idx, source, cow)?;
            returned.insert(0, cow);
        }
    }
    st.blocks.extend_from_slice(&new_blocks);
    st.allocated = true;
    st.partial_hit = None;
    returned.extend_from_slice(&new_blocks);
    Ok(returned)
}

/// `_relocate_speculative_block`: move the exclusively owned, unhashed block at `idx` to the
/// end of the table, leaving the null block in its place.
pub fn relocate_speculative_block(pool: &BlockPool, blocks: &mut Vec<u32>, idx: i64) -> Result<()> {
    let i = if idx < 0 { blocks.len() as i64 + idx } else { idx };
    if i < 0 || i as usize >= blocks.len() {
        return Err(Error::Assertion(format!("speculative block index {idx} is outside the table")));
    }
    let b = blocks[i as usize];
    if !pool.is_block_writable(b)? {
        return Err(Error::Assertion(
            "Speculative Mamba blocks must be exclusively owned and unhashed before relocation".into(),
        ));
    }
    blocks.push(b);
    blocks[i as usize] = NULL_BLOCK;
    Ok(())
}

/// `MambaManager.cache_blocks`.
#[allow(clippy::too_many_arguments)] // vLLM's signature
pub fn cache_blocks(
    cfg: &TypeConfig,
    ts: &mut TypeState,
    pool: &mut BlockPool,
    st: &mut ReqState,
    req: &ReqInfo<'_>,
    hashes: &dyn HashSource,
    num_tokens: usize,
    retention_interval: Option<usize>,
    replay_boundaries: &[usize],
) -> Result<()> {
    let before = st.num_cached.unwrap_or(0);
    cfg.base_cache_blocks(pool, st, req, hashes, num_tokens, retention_interval, replay_boundaries)?;
    let after = st.num_cached.unwrap_or(0);
    let align = cfg.is_mamba_align();
    if align {
        if let Some(key) = cache_partial_tail_block(cfg, pool, st, req, hashes, num_tokens, retention_interval)? {
            ts.cached_this_step.insert(key);
        }
    }
    if after > before {
        let blocks = st.table();
        if after > blocks.len() {
            return Err(Error::Assertion(format!("cached {after} blocks of a table of {}", blocks.len())));
        }
        for &b in &blocks[before..after] {
            if b == NULL_BLOCK {
                continue;
            }
            let Some(key) = pool.block_key(b)? else { continue };
            ts.cached_this_step.insert(key);
            if align {
                let t = pool
                    .block_hash_num_tokens(b)?
                    .ok_or_else(|| Error::Assertion("a cached Mamba state has no token count".into()))?;
                ts.pending_offloads.push((req.request_id.to_string(), cfg.group_id, b, t));
            }
        }
    }
    Ok(())
}

/// `MambaManager._cache_partial_tail_block`: key the reserved checkpoint block at its
/// boundary, or the prompt's last hash boundary state inside a block.
fn cache_partial_tail_block(
    cfg: &TypeConfig,
    pool: &mut BlockPool,
    st: &mut ReqState,
    req: &ReqInfo<'_>,
    hashes: &dyn HashSource,
    num_tokens: usize,
    retention_interval: Option<usize>,
) -> Result<Option<Key>> {
    let h = pool.hash_block_size();
    let lookahead = pool.num_hash_lookahead_tokens();
    if let Some((position, idx)) = st.checkpoint {
        let blocks = st.table();
        if idx >= blocks.len() {
            return Err(Error::Assertion(format!("checkpoint index {idx} is outside the table")));
        }
        let ckpt = blocks[idx];
        let is_prompt_checkpoint = position
            == prefill_checkpoint_position(
                req.num_prompt_tokens,
                cfg.cache_hit_alignment_tokens,
                cfg.drop_eagle_checkpoint_block,
                lookahead,
            );
        let mut retained = false;
        if position % cfg.block_size == 0 && position >= cfg.block_size {
            let bi = position / cfg.block_size - 1;
            retained = match reachable_block_mask(
                cfg.spec.block_size,
                bi,
                bi + 1,
                Some(cfg.cache_hit_alignment_tokens),
                retention_interval,
                &[],
            ) {
                None => true,
                Some(m) => m[0],
            };
        }
        if !is_prompt_checkpoint && !retained && position != req.shared_prefix_boundary {
            // the transient state overwrites this slot: nothing in it is reusable
            pool.maybe_evict_cached_block(ckpt)?;
            return Ok(None);
        }
        if pool.block_hash_num_tokens(ckpt)? == Some(position) {
            return Ok(None);
        }
        return pool.cache_partial_block(ckpt, hashes, position, cfg.group_id, cfg.block_size, true, req.event_tag);
    }
    if num_tokens == 0 || !num_tokens.is_multiple_of(h) {
        return Ok(None);
    }
    let latest = prefill_checkpoint_position(req.num_prompt_tokens, h, cfg.drop_eagle_checkpoint_block, lookahead);
    let junction = cfg.shared_prefix_checkpoint
        && num_tokens == req.shared_prefix_boundary
        && req.num_computed_tokens < num_tokens
        && num_tokens <= req.num_prompt_tokens;
    if num_tokens != latest && !junction {
        return Ok(None);
    }
    let block_idx = cdiv(num_tokens, cfg.block_size) - 1;
    let blocks = st.table();
    if block_idx >= blocks.len() {
        return Ok(None);
    }
    let source = blocks[block_idx];
    if source == NULL_BLOCK {
        return Ok(None);
    }
    // already keyed here by a hit or an earlier step (0.32 registers it again)
    if !cfg.rules.partial_tail_rekeyed && pool.block_hash_num_tokens(source)? == Some(num_tokens) {
        return Ok(None);
    }
    let key =
        pool.cache_partial_block(source, hashes, num_tokens, cfg.group_id, cfg.block_size, false, req.event_tag)?;
    if key.is_some() && !num_tokens.is_multiple_of(cfg.block_size) {
        st.partial_hit = Some((table_index(block_idx), source));
        st.num_cached = Some(block_idx);
        st.producer_tail = Some((source, num_tokens));
    }
    Ok(key)
}
