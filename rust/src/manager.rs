//! vLLM's `KVCacheManager` arithmetic for one KV-cache group (spec §5, §6.2): per-request block
//! tables, prefix-cache lookup, `allocate_slots`, `cache_blocks` and `free`, so that one Python
//! call performs one scheduler action.
//!
//! The group is full attention, or sliding-window attention when `sliding_window` is set. The
//! block pool is passed in (it is shared with the pool's own Python face).

use crate::block_pool::{BlockPool, NULL_BLOCK};
use crate::error::{Error, Result};
use crate::hashing::Digest;
use hashbrown::HashMap;

/// Per-request bookkeeping (`req_to_blocks`, `num_cached_block`).
#[derive(Clone, Debug, Default)]
pub struct ReqState {
    /// The block table, in token order (null blocks where a sliding window skipped).
    pub blocks: Vec<u32>,
    /// Blocks already cached; `None` until the request is known to `num_cached_block`.
    pub num_cached: Option<usize>,
}

/// The inputs of one `allocate_slots` call, besides the request's hashes.
#[derive(Clone, Debug, Default)]
pub struct AllocArgs<'a> {
    /// `request.num_computed_tokens`.
    pub num_computed_tokens: usize,
    /// `request.num_tokens` (prompt + output).
    pub num_tokens: usize,
    /// Tokens to compute in this step.
    pub num_new_tokens: usize,
    /// Tokens newly found in the prefix cache.
    pub num_new_computed_tokens: usize,
    /// The prefix-cache hit blocks (`new_computed_blocks`).
    pub new_computed: &'a [u32],
    /// True if the caller passed hit blocks (even an empty, non-shared list).
    pub has_new_computed: bool,
    /// Speculative tokens to reserve slots for.
    pub num_lookahead_tokens: usize,
    /// Tokens whose KV a connector provides.
    pub num_external_computed_tokens: usize,
    /// Skip caching (P/D asynchronous loads).
    pub delay_cache_blocks: bool,
    /// Check that the whole sequence fits before allocating.
    pub full_sequence_must_fit: bool,
    /// Free blocks to leave untouched for other sequences.
    pub reserved_blocks: usize,
    /// Apply the watermark (a waiting/preempted request while others are scheduled).
    pub apply_watermark: bool,
    /// Tokens of steps still in flight (not yet safe to free out of a sliding window).
    pub num_in_flight_tokens: usize,
    /// Opaque handle recorded in `BlockStored` events.
    pub event_tag: u64,
}

/// The manager of one KV-cache group.
#[derive(Clone)]
pub struct Manager {
    block_size: usize,
    max_model_len: usize,
    enable_caching: bool,
    use_eagle: bool,
    sliding_window: Option<usize>,
    watermark_blocks: usize,
    reqs: HashMap<String, ReqState>,
    scratch: Vec<u32>,
}

#[inline(always)]
fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl Manager {
    /// A manager for blocks of `block_size` tokens (= the hash block size).
    pub fn new(
        block_size: usize,
        max_model_len: usize,
        enable_caching: bool,
        use_eagle: bool,
        sliding_window: Option<usize>,
        watermark_blocks: usize,
    ) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::value("block_size", "must be > 0"));
        }
        if max_model_len == 0 {
            return Err(Error::value("max_model_len", "must be > 0"));
        }
        if sliding_window == Some(0) {
            return Err(Error::value("sliding_window", "must be > 0"));
        }
        Ok(Manager {
            block_size,
            max_model_len,
            enable_caching,
            use_eagle,
            sliding_window,
            watermark_blocks,
            reqs: HashMap::new(),
            scratch: Vec::new(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The longest sequence the model accepts.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// True for a sliding-window group.
    pub fn is_sliding_window(&self) -> bool {
        self.sliding_window.is_some()
    }

    /// Number of requests holding state.
    pub fn num_requests(&self) -> usize {
        self.reqs.len()
    }

    /// The block table of a request (empty if unknown).
    pub fn block_ids(&self, req: &str) -> &[u32] {
        self.reqs.get(req).map(|s| s.blocks.as_slice()).unwrap_or(&[])
    }

    /// The state of a request.
    pub fn state(&self, req: &str) -> Option<&ReqState> {
        self.reqs.get(req)
    }

    /// Tokens before the attention window of a sequence of `n` computed tokens.
    #[inline]
    fn num_skipped_tokens(&self, n: usize) -> usize {
        match self.sliding_window {
            Some(w) => (n + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// `find_longest_cache_hit`: the cached blocks of the longest hit of at most `max_length`
    /// tokens. `hash_at(i)` gives the request's `i`-th block hash; `num_hashes` how many exist.
    pub fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        num_hashes: usize,
        max_length: usize,
        mut hash_at: impl FnMut(usize) -> Result<Digest>,
    ) -> Result<Vec<u32>> {
        let max_blocks = (max_length / self.block_size).min(num_hashes);
        let mut hit = Vec::new();
        match self.sliding_window {
            None => {
                for i in 0..max_blocks {
                    match pool.lookup(&hash_at(i)?, 0) {
                        Some(b) => hit.push(b),
                        None => break,
                    }
                }
            }
            Some(w) => {
                // right to left, looking for enough contiguous hits to fill the window
                let need = cdiv(w - 1, self.block_size) + self.use_eagle as usize;
                hit = vec![NULL_BLOCK; max_blocks];
                let mut run = 0;
                let mut found = false;
                for i in (0..max_blocks).rev() {
                    match pool.lookup(&hash_at(i)?, 0) {
                        Some(b) => {
                            hit[i] = b;
                            run += 1;
                            if run >= need {
                                hit.truncate(i + run);
                                found = true;
                                break;
                            }
                        }
                        None => run = 0,
                    }
                }
                if !found {
                    hit.truncate(run);
                }
            }
        }
        if self.use_eagle && !hit.is_empty() {
            hit.pop();
        }
        Ok(hit)
    }

    /// `get_num_blocks_to_allocate` for `num_tokens` slots.
    fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        state: Option<&ReqState>,
        num_tokens: usize,
        new_computed: &[u32],
        total_computed: usize,
    ) -> Result<usize> {
        let required = cdiv(num_tokens, self.block_size);
        let have = state.map(|s| s.blocks.len()).unwrap_or(0);
        if state.is_some_and(|s| s.num_cached.is_some()) {
            // a running request
            return Ok(required.saturating_sub(have));
        }
        let skipped = self.num_skipped_tokens(total_computed) / self.block_size;
        let new = required.saturating_sub(skipped.max(new_computed.len() + have));
        let skip_hits = skipped.min(new_computed.len());
        let mut evictable = 0;
        for &b in &new_computed[skip_hits..] {
            // a free hit block leaves the free pool when it is touched
            if b != NULL_BLOCK && pool.ref_cnt(b)? == 0 {
                evictable += 1;
            }
        }
        Ok(new + evictable)
    }

    /// `remove_skipped_blocks`: replace blocks that fell out of the sliding window by the null
    /// block and free them (tail first). A no-op for full attention.
    pub fn remove_skipped_blocks(&mut self, pool: &mut BlockPool, req: &str, num_computed_tokens: usize) -> Result<()> {
        let skipped_tokens = self.num_skipped_tokens(num_computed_tokens);
        if skipped_tokens == 0 {
            return Ok(());
        }
        let Some(state) = self.reqs.get_mut(req) else { return Ok(()) };
        let last = (skipped_tokens / self.block_size).min(state.blocks.len());
        let mut removed = std::mem::take(&mut self.scratch);
        removed.clear();
        for i in (0..last).rev() {
            if state.blocks[i] == NULL_BLOCK {
                break;
            }
            removed.push(state.blocks[i]);
        }
        let res = pool.free_blocks(&removed, true);
        if res.is_ok() {
            for i in last - removed.len()..last {
                state.blocks[i] = NULL_BLOCK;
            }
        }
        self.scratch = removed;
        res
    }

    /// `allocate_slots` (spec §5.3). Returns `Ok(None)` — with no side effect — when the pool
    /// cannot supply the blocks, else the newly allocated block ids. `hash_at(i)` gives the
    /// request's `i`-th block hash, `num_hashes` how many there are.
    pub fn allocate_slots(
        &mut self,
        pool: &mut BlockPool,
        req: &str,
        a: &AllocArgs<'_>,
        num_hashes: usize,
        hash_at: impl FnMut(usize) -> Result<Digest>,
    ) -> Result<Option<Vec<u32>>> {
        if a.num_new_tokens == 0 && a.num_new_computed_tokens == 0 && a.num_external_computed_tokens == 0 {
            return Err(Error::value(
                "num_new_tokens",
                "must be > 0 when there are no computed tokens to adopt",
            ));
        }
        if a.num_tokens > self.max_model_len {
            return Err(Error::value(
                "request",
                format!("{} tokens exceed max_model_len {}", a.num_tokens, self.max_model_len),
            ));
        }
        for &b in a.new_computed {
            pool.ref_cnt(b)?; // range check
        }
        let running = self.reqs.get(req).is_some_and(|s| s.num_cached.is_some());
        if running && !a.new_computed.is_empty() {
            return Err(Error::value("new_computed_blocks", "a running request cannot adopt new computed blocks"));
        }
        let num_local_computed = a.num_computed_tokens + a.num_new_computed_tokens;
        let total_computed = (num_local_computed + a.num_external_computed_tokens).min(self.max_model_len);
        let watermark = if a.apply_watermark { self.watermark_blocks } else { 0 };
        let free = pool.num_free_blocks();

        if a.full_sequence_must_fit {
            let full = a.num_tokens.min(self.max_model_len);
            let need = self.num_blocks_to_allocate(pool, self.reqs.get(req), full, a.new_computed, total_computed)?;
            if need + watermark > free {
                return Ok(None);
            }
        }
        let num_tokens_main = total_computed + a.num_new_tokens;
        let need_slot = (num_tokens_main + a.num_lookahead_tokens).min(self.max_model_len);

        // Runs even if the allocation then fails (vLLM frees out-of-window blocks first).
        if self.sliding_window.is_some() {
            let processed = total_computed.saturating_sub(a.num_in_flight_tokens);
            self.remove_skipped_blocks(pool, req, processed)?;
        }
        let free = pool.num_free_blocks();
        let need = self.num_blocks_to_allocate(
            pool,
            self.reqs.get(req),
            need_slot,
            a.new_computed,
            num_local_computed + a.num_external_computed_tokens,
        )?;
        if (need + watermark) as i64 > free as i64 - a.reserved_blocks as i64 {
            return Ok(None);
        }

        let state = self.reqs.entry_ref(req).or_default();
        if (a.has_new_computed || a.num_external_computed_tokens > 0) && state.num_cached.is_none() {
            // allocate_new_computed_blocks: touch the hits, pad skipped positions with null
            debug_assert!(state.blocks.is_empty());
            let total = num_local_computed + a.num_external_computed_tokens;
            let skipped_tokens = match self.sliding_window {
                Some(w) => (total + 1).saturating_sub(w),
                None => 0,
            };
            let skipped = skipped_tokens / self.block_size;
            let hits = &a.new_computed[skipped.min(a.new_computed.len())..];
            if self.enable_caching {
                pool.touch(hits, true)?;
            }
            state.blocks.resize(skipped, NULL_BLOCK);
            state.blocks.extend_from_slice(hits);
            state.num_cached = Some(state.blocks.len());
            if a.num_external_computed_tokens > 0 {
                let n = cdiv(total, self.block_size).saturating_sub(state.blocks.len());
                pool.get_new_blocks(n, &mut state.blocks)?;
            }
        }
        let mut new = Vec::new();
        let n = cdiv(need_slot, self.block_size).saturating_sub(state.blocks.len());
        if n > 0 {
            pool.get_new_blocks(n, &mut new)?;
            state.blocks.extend_from_slice(&new);
        }
        if !self.enable_caching || a.delay_cache_blocks {
            return Ok(Some(new));
        }
        let to_cache = (total_computed + a.num_new_tokens).min(a.num_tokens);
        self.cache_blocks(pool, req, to_cache, num_hashes, hash_at, a.event_tag)?;
        Ok(Some(new))
    }

    /// `cache_blocks(request, num_computed_tokens)`: cache the request's full blocks up to
    /// `num_tokens` tokens (capped by the hashes that exist).
    pub fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        req: &str,
        num_tokens: usize,
        num_hashes: usize,
        mut hash_at: impl FnMut(usize) -> Result<Digest>,
        event_tag: u64,
    ) -> Result<()> {
        if !self.enable_caching {
            return Ok(());
        }
        let Some(state) = self.reqs.get_mut(req) else { return Ok(()) };
        let num_cached = state.num_cached.unwrap_or(0);
        let num_full = (num_tokens.min(num_hashes * self.block_size) / self.block_size).min(state.blocks.len());
        if num_cached >= num_full {
            return Ok(());
        }
        let mut hashes = Vec::with_capacity(num_full - num_cached);
        for i in num_cached..num_full {
            hashes.push(hash_at(i)?);
        }
        let parent = if num_cached > 0 { Some(hash_at(num_cached - 1)?) } else { None };
        pool.cache_blocks(&state.blocks, num_cached, &hashes, parent, self.block_size, 0, true, event_tag)?;
        state.num_cached = Some(num_full);
        Ok(())
    }

    /// `free(request)`: release the table tail first and forget the request. Unknown ids are a
    /// no-op. Returns whether the request held state.
    pub fn free(&mut self, pool: &mut BlockPool, req: &str) -> Result<bool> {
        let Some(state) = self.reqs.get(req) else { return Ok(false) };
        let mut order = std::mem::take(&mut self.scratch);
        order.clear();
        order.extend(state.blocks.iter().rev().copied().filter(|&b| b != NULL_BLOCK));
        let res = pool.free_blocks(&order, true);
        self.scratch = order;
        res?;
        self.reqs.remove(req);
        Ok(true)
    }

    /// Forget every request without touching the pool (used when a pool is rebuilt).
    pub fn clear(&mut self) {
        self.reqs.clear();
    }
}
