//! vLLM's `KVCacheManager` arithmetic for one KV-cache group (spec §5, §6.2): per-request block
//! tables, prefix-cache lookup, `allocate_slots`, `cache_blocks` and `free`, so that one Python
//! call performs one scheduler action.
//!
//! The group is full attention, or sliding-window attention when `sliding_window` is set. The
//! block pool is passed in (it is shared with the pool's own Python face).

pub mod requests;

use crate::error::{Error, Result};
use crate::hashing::Digest;
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};
use requests::RequestTable;
use std::sync::atomic::Ordering::Relaxed;

/// A request's block hashes, read lazily (the binding reads them straight from the Python
/// list, only as far as a lookup or caching needs).
pub trait HashSource {
    /// Number of hashes.
    fn len(&self) -> usize;
    /// The raw bytes of hash `i` (16 or 32 bytes).
    fn get(&self, i: usize) -> Result<&[u8]>;
    /// True if there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Hash `i` as a [`Digest`].
    fn digest(&self, i: usize) -> Result<Digest> {
        let b = self.get(i)?;
        Digest::from_slice(b).ok_or_else(|| {
            Error::value("block_hashes", format!("a block hash must be 16 or 32 bytes, got {}", b.len()))
        })
    }
}

impl HashSource for [Digest] {
    fn len(&self) -> usize {
        <[Digest]>::len(self)
    }
    fn get(&self, i: usize) -> Result<&[u8]> {
        self.as_ref()
            .get(i)
            .map(|d| d.as_bytes())
            .ok_or_else(|| Error::value("block_hashes", format!("index {i} out of range")))
    }
}

impl HashSource for Vec<Digest> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn get(&self, i: usize) -> Result<&[u8]> {
        HashSource::get(self.as_slice(), i)
    }
}

/// Per-request bookkeeping (`req_to_blocks`, `num_cached_block`).
#[derive(Debug, Default)]
pub struct ReqState {
    /// The block table, in token order (null blocks where a sliding window skipped).
    pub blocks: Vec<u32>,
    /// Blocks already cached; `None` until the request is known to `num_cached_block`.
    pub num_cached: Option<usize>,
    /// The batch that last prepared this request (see [`Manager::new_batch_mark`]).
    batch_mark: std::sync::atomic::AtomicU64,
}

impl Clone for ReqState {
    fn clone(&self) -> Self {
        ReqState { blocks: self.blocks.clone(), num_cached: self.num_cached, batch_mark: Default::default() }
    }
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

/// The fixed configuration of a manager.
#[derive(Clone, Copy, Debug)]
struct Config {
    block_size: usize,
    max_model_len: usize,
    enable_caching: bool,
    use_eagle: bool,
    sliding_window: Option<usize>,
    watermark_blocks: usize,
}

impl Config {
    /// Tokens before the attention window of a sequence of `n` computed tokens.
    #[inline]
    fn num_skipped_tokens(&self, n: usize) -> usize {
        match self.sliding_window {
            Some(w) => (n + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// `get_num_blocks_to_allocate` for `num_tokens` slots.
    fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        state: &ReqState,
        num_tokens: usize,
        new_computed: &[u32],
        total_computed: usize,
    ) -> Result<usize> {
        let required = cdiv(num_tokens, self.block_size);
        let have = state.blocks.len();
        if state.num_cached.is_some() {
            // a running request
            return Ok(required.saturating_sub(have));
        }
        let skipped = self.num_skipped_tokens(total_computed) / self.block_size;
        let new = required.saturating_sub(skipped.max(new_computed.len() + have));
        let skip_hits = skipped.min(new_computed.len());
        // a free hit block leaves the free pool when it is touched
        Ok(new + pool.count_free(&new_computed[skip_hits..]))
    }

    /// Free the blocks of `state` that left the sliding window (tail first).
    fn remove_skipped_blocks(
        &self,
        pool: &mut BlockPool,
        state: &mut ReqState,
        num_computed_tokens: usize,
        scratch: &mut Vec<u32>,
    ) -> Result<()> {
        let skipped_tokens = self.num_skipped_tokens(num_computed_tokens);
        if skipped_tokens == 0 {
            return Ok(());
        }
        let last = (skipped_tokens / self.block_size).min(state.blocks.len());
        scratch.clear();
        for i in (0..last).rev() {
            if state.blocks[i] == NULL_BLOCK {
                break;
            }
            scratch.push(state.blocks[i]);
        }
        pool.free_blocks(scratch, true)?;
        for i in last - scratch.len()..last {
            state.blocks[i] = NULL_BLOCK;
        }
        Ok(())
    }

    /// What caching a request's full blocks up to `num_tokens` tokens would do, given that it
    /// then holds `num_cached` cached blocks of `num_blocks`: the first block to cache, the new
    /// hashes and the parent hash. Reads and validates every hash first, so that a request with
    /// bad hashes fails before anything changes. `None` when there is nothing to cache.
    fn plan_cache<H: HashSource + ?Sized>(
        &self,
        num_cached: usize,
        num_blocks: usize,
        num_tokens: usize,
        hashes: &H,
    ) -> Result<Option<CachePlan>> {
        let num_full = (num_tokens.min(hashes.len() * self.block_size) / self.block_size).min(num_blocks);
        if !self.enable_caching || num_cached >= num_full {
            return Ok(None);
        }
        let mut new_hashes = Vec::with_capacity(num_full - num_cached);
        for i in num_cached..num_full {
            new_hashes.push(hashes.digest(i)?);
        }
        let parent = if num_cached > 0 { Some(hashes.digest(num_cached - 1)?) } else { None };
        Ok(Some(CachePlan { first: num_cached, hashes: new_hashes, parent }))
    }

    /// Carry out a [`CachePlan`] on `state`.
    fn apply_cache(&self, pool: &mut BlockPool, state: &mut ReqState, plan: CachePlan, event_tag: u64) -> Result<()> {
        let end = plan.first + plan.hashes.len();
        pool.cache_blocks(&state.blocks, plan.first, &plan.hashes, plan.parent, self.block_size, 0, true, event_tag)?;
        state.num_cached = Some(end);
        Ok(())
    }

    /// Cache `state`'s full blocks up to `num_tokens` tokens.
    fn cache_blocks<H: HashSource + ?Sized>(
        &self,
        pool: &mut BlockPool,
        state: &mut ReqState,
        num_tokens: usize,
        hashes: &H,
        event_tag: u64,
    ) -> Result<()> {
        match self.plan_cache(state.num_cached.unwrap_or(0), state.blocks.len(), num_tokens, hashes)? {
            Some(plan) => self.apply_cache(pool, state, plan, event_tag),
            None => Ok(()),
        }
    }

    /// Check an `allocate_slots` call and work out its effect on the request's table and
    /// cache, without changing anything: every error the call can raise is raised here
    /// (arguments, hashes of the blocks it would cache).
    #[inline(always)]
    fn prepare<H: HashSource>(
        &self,
        pool: &BlockPool,
        state: Option<&ReqState>,
        a: &AllocArgs<'_>,
        hashes: impl FnOnce() -> Result<H>,
    ) -> Result<Prepared> {
        let cfg = self;
        if a.num_new_tokens == 0 && a.num_new_computed_tokens == 0 && a.num_external_computed_tokens == 0 {
            return Err(Error::value("num_new_tokens", "must be > 0 when there are no computed tokens to adopt"));
        }
        if a.num_tokens > cfg.max_model_len {
            return Err(Error::value(
                "request",
                format!("{} tokens exceed max_model_len {}", a.num_tokens, cfg.max_model_len),
            ));
        }
        pool.check_ids(a.new_computed)?;
        if a.new_computed.len().checked_mul(cfg.block_size) != Some(a.num_new_computed_tokens) {
            return Err(Error::value(
                "num_new_computed_tokens",
                format!(
                    "{} must equal the hit blocks' tokens ({} blocks x {})",
                    a.num_new_computed_tokens,
                    a.new_computed.len(),
                    cfg.block_size
                ),
            ));
        }
        if state.is_some() && !a.new_computed.is_empty() {
            return Err(Error::value(
                "new_computed_blocks",
                "the request already holds blocks and cannot adopt new computed blocks",
            ));
        }
        if a.num_external_computed_tokens > 0 && state.is_some_and(|s| s.num_cached.is_none() && !s.blocks.is_empty()) {
            // vLLM asserts the table is empty when it adopts computed tokens
            return Err(Error::value(
                "num_external_computed_tokens",
                "the request already holds blocks and cannot adopt external computed tokens",
            ));
        }
        let empty = ReqState::default();
        let state = state.unwrap_or(&empty);
        // Token counts saturate: a sum past usize::MAX is refused below anyway.
        let total = a
            .num_computed_tokens
            .saturating_add(a.num_new_computed_tokens)
            .saturating_add(a.num_external_computed_tokens);
        if total > cfg.max_model_len {
            // The capacity check counts slots up to max_model_len, while adopting external
            // tokens takes blocks for all of them: past max_model_len the adoption would fail
            // after the hits were touched. No request has more computed tokens than that.
            return Err(computed_past_max_model_len(a, cfg.max_model_len));
        }
        let total_computed = total;
        let need_slot = total_computed
            .saturating_add(a.num_new_tokens)
            .saturating_add(a.num_lookahead_tokens)
            .min(cfg.max_model_len);
        let adopt = (a.has_new_computed || a.num_external_computed_tokens > 0) && state.num_cached.is_none();
        let (mut len_after, cached_after) = if adopt {
            let skipped = cfg.num_skipped_tokens(total) / cfg.block_size;
            let l = state.blocks.len() + skipped + a.new_computed.len() - skipped.min(a.new_computed.len());
            (
                if cfg.external_after_skip(total, a.num_external_computed_tokens) > 0 {
                    l.max(cdiv(total, cfg.block_size))
                } else {
                    l
                },
                l,
            )
        } else {
            (state.blocks.len(), state.num_cached.unwrap_or(0))
        };
        len_after = len_after.max(cdiv(need_slot, cfg.block_size));
        let to_cache = total_computed.saturating_add(a.num_new_tokens).min(a.num_tokens);
        let plan = if cfg.enable_caching && !a.delay_cache_blocks && to_cache / cfg.block_size > cached_after {
            cfg.plan_cache(cached_after, len_after, to_cache, &hashes()?)?
        } else {
            None
        };
        Ok(Prepared { slot: None, total, need_slot, adopt, plan: plan.map(Box::new) })
    }

    /// External tokens that still need blocks once `total` computed tokens are known: those
    /// inside the attention window (all of them for full attention).
    #[inline]
    fn external_after_skip(&self, total: usize, external: usize) -> usize {
        let skipped_tokens = self.num_skipped_tokens(total);
        if skipped_tokens > 0 {
            external.min(total - skipped_tokens)
        } else {
            external
        }
    }

    /// Carry out a prepared `allocate_slots` on `state`: `Ok(None)` (with only the
    /// sliding-window frees vLLM also makes) when the pool cannot supply the blocks.
    #[inline(always)]
    fn apply(
        &self,
        pool: &mut BlockPool,
        state: &mut ReqState,
        a: &AllocArgs<'_>,
        p: Prepared,
        scratch: &mut Vec<u32>,
    ) -> Result<Option<Vec<u32>>> {
        let cfg = self;
        let total_computed = p.total.min(cfg.max_model_len);
        let watermark = if a.apply_watermark { cfg.watermark_blocks } else { 0 };
        if a.full_sequence_must_fit {
            let full = a.num_tokens.min(cfg.max_model_len);
            let need = cfg.num_blocks_to_allocate(pool, state, full, a.new_computed, total_computed)?;
            if need + watermark > pool.num_free_blocks() {
                return Ok(None);
            }
        }
        // Runs even if the allocation then fails (vLLM frees out-of-window blocks first).
        if cfg.sliding_window.is_some() {
            let processed = total_computed.saturating_sub(a.num_in_flight_tokens);
            cfg.remove_skipped_blocks(pool, state, processed, scratch)?;
        }
        let need = cfg.num_blocks_to_allocate(pool, state, p.need_slot, a.new_computed, p.total)?;
        if (need + watermark) as i64 > pool.num_free_blocks() as i64 - a.reserved_blocks as i64 {
            return Ok(None);
        }
        if p.adopt {
            // allocate_new_computed_blocks: touch the hits and append them after null blocks
            // for the skipped positions (a request that already holds blocks adopts no hits:
            // `prepare` rejects that), then allocate blocks for the external tokens.
            let skipped = cfg.num_skipped_tokens(p.total) / cfg.block_size;
            let hits = &a.new_computed[skipped.min(a.new_computed.len())..];
            if cfg.enable_caching {
                pool.touch(hits, true)?;
            }
            state.blocks.extend(std::iter::repeat_n(NULL_BLOCK, skipped));
            state.blocks.extend_from_slice(hits);
            state.num_cached = Some(state.blocks.len());
            if cfg.external_after_skip(p.total, a.num_external_computed_tokens) > 0 {
                let n = cdiv(p.total, cfg.block_size).saturating_sub(state.blocks.len());
                pool.get_new_blocks(n, &mut state.blocks)?;
            }
        }
        let mut new = Vec::new();
        let n = cdiv(p.need_slot, cfg.block_size).saturating_sub(state.blocks.len());
        if n > 0 {
            pool.get_new_blocks(n, &mut new)?;
            state.blocks.extend_from_slice(&new);
        }
        if let Some(plan) = p.plan {
            cfg.apply_cache(pool, state, *plan, a.event_tag)?;
        }
        Ok(Some(new))
    }
}

/// The error for computed tokens (local, hit and external) past `max_model_len`, naming the
/// argument that took them there.
#[cold]
fn computed_past_max_model_len(a: &AllocArgs<'_>, max_model_len: usize) -> Error {
    let field = if a.num_external_computed_tokens > 0 {
        "num_external_computed_tokens"
    } else if a.num_new_computed_tokens > 0 {
        "num_new_computed_tokens"
    } else {
        "request.num_computed_tokens"
    };
    Error::value(
        field,
        format!(
            "{} computed + {} hit + {} external tokens exceed max_model_len {max_model_len}",
            a.num_computed_tokens, a.num_new_computed_tokens, a.num_external_computed_tokens
        ),
    )
}

/// The checked effect of an `allocate_slots` call (see [`Manager::prepare_allocate`]).
pub struct Prepared {
    /// The request's slot in the request table; `None` when it is not running yet.
    slot: Option<u32>,
    /// Computed tokens after the call (local + external), before the max_model_len cap.
    total: usize,
    /// Tokens that need slots.
    need_slot: usize,
    /// The request adopts the computed blocks (its first allocation).
    adopt: bool,
    /// Boxed: most calls cache nothing, and a batch keeps one `Prepared` per request.
    plan: Option<Box<CachePlan>>,
}

impl Prepared {
    /// True when the request is not running yet (it is added if the allocation succeeds).
    pub fn is_new(&self) -> bool {
        self.slot.is_none()
    }
}

/// Blocks a request is about to cache, with their hashes read in advance.
struct CachePlan {
    first: usize,
    hashes: Vec<Digest>,
    parent: Option<Digest>,
}

/// The manager of one KV-cache group.
#[derive(Clone)]
pub struct Manager {
    cfg: Config,
    reqs: RequestTable<ReqState>,
    scratch: Vec<u32>,
    batch_epoch: u64,
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
            cfg: Config { block_size, max_model_len, enable_caching, use_eagle, sliding_window, watermark_blocks },
            reqs: RequestTable::default(),
            scratch: Vec::new(),
            batch_epoch: 0,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }

    /// The longest sequence the model accepts.
    pub fn max_model_len(&self) -> usize {
        self.cfg.max_model_len
    }

    /// True for a sliding-window group.
    pub fn is_sliding_window(&self) -> bool {
        self.cfg.sliding_window.is_some()
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

    /// `find_longest_cache_hit`: the cached blocks of the longest hit of at most `max_length`
    /// tokens, given the request's block hashes.
    pub fn find_longest_cache_hit<H: HashSource + ?Sized>(
        &self,
        pool: &BlockPool,
        hashes: &H,
        max_length: usize,
    ) -> Result<Vec<u32>> {
        let cfg = &self.cfg;
        let max_blocks = (max_length / cfg.block_size).min(hashes.len());
        let mut hit = Vec::new();
        match cfg.sliding_window {
            None => {
                for i in 0..max_blocks {
                    match pool.lookup_bytes(hashes.get(i)?, 0) {
                        Some(b) => hit.push(b),
                        None => break,
                    }
                }
            }
            Some(w) => {
                // right to left, looking for enough contiguous hits to fill the window
                let need = cdiv(w - 1, cfg.block_size) + cfg.use_eagle as usize;
                hit = vec![NULL_BLOCK; max_blocks];
                let mut run = 0;
                let mut found = false;
                for i in (0..max_blocks).rev() {
                    match pool.lookup_bytes(hashes.get(i)?, 0) {
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
        if cfg.use_eagle && !hit.is_empty() {
            hit.pop();
        }
        Ok(hit)
    }

    /// `remove_skipped_blocks`: replace blocks that fell out of the sliding window by the null
    /// block and free them (tail first). A no-op for full attention or an unknown request.
    pub fn remove_skipped_blocks(&mut self, pool: &mut BlockPool, req: &str, num_computed_tokens: usize) -> Result<()> {
        let Some(state) = self.reqs.get_mut(req) else { return Ok(()) };
        self.cfg.remove_skipped_blocks(pool, state, num_computed_tokens, &mut self.scratch)
    }

    /// A fresh batch mark for [`Manager::prepare_allocate`].
    pub fn new_batch_mark(&mut self) -> u64 {
        self.batch_epoch += 1;
        self.batch_epoch
    }

    /// Check an `allocate_slots(req, a)` call and work out its effect, changing nothing: every
    /// error the call can raise is raised here. A batch prepares all its requests before it
    /// applies any ([`Manager::apply_allocate`]), passing one `batch_mark` (0: none) so that a
    /// running request prepared twice in the batch is an error; the caller checks the
    /// requests that come back `is_new` for repeats.
    pub fn prepare_allocate<H: HashSource>(
        &self,
        pool: &BlockPool,
        req: &str,
        a: &AllocArgs<'_>,
        hashes: impl FnOnce() -> Result<H>,
        batch_mark: u64,
    ) -> Result<Prepared> {
        match self.reqs.slot(req) {
            Some(slot) => {
                let state = self.reqs.at(slot);
                if batch_mark != 0 {
                    // An atomic only so the mark is writable through &self; a batch is
                    // prepared by one caller, so a relaxed load and store (no locked
                    // read-modify-write) are enough.
                    if state.batch_mark.load(Relaxed) == batch_mark {
                        return Err(Error::value("requests", format!("request {req:?} is listed twice")));
                    }
                    state.batch_mark.store(batch_mark, Relaxed);
                }
                Ok(Prepared { slot: Some(slot), ..self.cfg.prepare(pool, Some(state), a, hashes)? })
            }
            None => self.cfg.prepare(pool, None, a, hashes),
        }
    }

    /// Carry out an `allocate_slots` prepared by [`Manager::prepare_allocate`] with the same
    /// `req` and `a`, nothing having changed the request since (a running request is found by
    /// the slot noted then, without a lookup).
    pub fn apply_allocate(
        &mut self,
        pool: &mut BlockPool,
        req: &str,
        a: &AllocArgs<'_>,
        p: Prepared,
    ) -> Result<Option<Vec<u32>>> {
        let cfg = self.cfg;
        match p.slot {
            Some(slot) => cfg.apply(pool, self.reqs.at_mut(slot), a, p, &mut self.scratch),
            None => {
                let mut state = ReqState::default();
                let res = cfg.apply(pool, &mut state, a, p, &mut self.scratch)?;
                if res.is_some() {
                    self.reqs.insert(req, state);
                }
                Ok(res)
            }
        }
    }

    /// `allocate_slots` (spec §5.3). Returns `Ok(None)` — with no side effect but the
    /// sliding-window frees vLLM also makes — when the pool cannot supply the blocks, else the
    /// newly allocated block ids. `hashes()` gives the request's block hashes; it is called
    /// only if blocks are to be cached. An error leaves everything unchanged.
    pub fn allocate_slots<H: HashSource>(
        &mut self,
        pool: &mut BlockPool,
        req: &str,
        a: &AllocArgs<'_>,
        hashes: impl FnOnce() -> Result<H>,
    ) -> Result<Option<Vec<u32>>> {
        let cfg = self.cfg;
        // One lookup of the request: a running request is updated in place, a new one is
        // built aside and inserted only once the allocation succeeds.
        match self.reqs.get_mut(req) {
            Some(state) => {
                let p = cfg.prepare(pool, Some(state), a, hashes)?;
                cfg.apply(pool, state, a, p, &mut self.scratch)
            }
            None => {
                let mut state = ReqState::default();
                let p = cfg.prepare(pool, None, a, hashes)?;
                let res = cfg.apply(pool, &mut state, a, p, &mut self.scratch)?;
                if res.is_some() {
                    self.reqs.insert(req, state);
                }
                Ok(res)
            }
        }
    }

    /// `cache_blocks(request, num_computed_tokens)`: cache the request's full blocks up to
    /// `num_tokens` tokens (capped by the hashes that exist). A no-op for unknown requests.
    pub fn cache_blocks<H: HashSource + ?Sized>(
        &mut self,
        pool: &mut BlockPool,
        req: &str,
        num_tokens: usize,
        hashes: &H,
        event_tag: u64,
    ) -> Result<()> {
        let Some(state) = self.reqs.get_mut(req) else { return Ok(()) };
        self.cfg.cache_blocks(pool, state, num_tokens, hashes, event_tag)
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
