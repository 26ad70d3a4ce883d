//! vLLM's `BlockPool` over a struct-of-arrays block arena (spec §2–§4).
//!
//! Block 0 is the null block. A block is free iff it is linked into the free queue; free blocks
//! may still carry a hash (they are eviction candidates) and are evicted lazily when
//! allocation pops them. A block has at most one *primary* key (vLLM's `block.block_hash`, with
//! `block_hash_num_tokens`) and, rarely, further keys (vLLM's `cached_block_hashes_by_block`:
//! partial-prefix entries of fine-grained hybrid models). Every fallible operation validates
//! its whole input before it changes anything, so a failed call leaves the pool as it was.

use crate::error::{Error, Result};
use crate::hashing::source::HashSource;
use crate::hashing::Digest;
use crate::pool::cache_map::{CacheMap, Key};
use crate::pool::events::{next_tick, Event, Medium};
use crate::pool::free_queue::{FreeQueue, UNLINKED};
use crate::pool::residency::{now_ns, Residency};
use crate::pool::retention::{Retention, NUM_LEVELS};
use hashbrown::HashMap;

/// The null block's id.
pub const NULL_BLOCK: u32 = 0;
const NO_KEY: u32 = u32::MAX;
const NO_TOKENS: u32 = u32::MAX;

/// A block's own state, kept together so that handing a block out, evicting it or caching it
/// reads one cache line for it rather than one per field.
#[derive(Clone, Copy, Debug)]
struct BlockMeta {
    ref_cnt: u32,
    /// Slot of the block's primary key in `map`, or `NO_KEY`.
    key_slot: u32,
    /// `block_hash_num_tokens` of the primary key, or `NO_TOKENS` (None).
    key_tokens: u32,
    /// Times the block was handed out anew or lost its keys: a hit read at generation `g` is
    /// still the block it named iff the generation is still `g`.
    generation: u32,
}

impl BlockMeta {
    /// A block never used: no references, no key, generation 0.
    const FREE: BlockMeta = BlockMeta { ref_cnt: 0, key_slot: NO_KEY, key_tokens: NO_TOKENS, generation: 0 };
}

/// The reuse watchers of [`BlockPool::unpin_blocks`], by block id: `(order of first
/// registration, watcher id)`, order 0 for a block with none. A vector indexed by the id,
/// sized for the pool on the first registration (empty until then), not a hash map:
/// `get_new_blocks` asks for every block it hands out while any watcher is recorded.
#[derive(Clone, Default)]
struct Watchers {
    by_block: Vec<(u64, u64)>,
    /// Blocks with a watcher.
    len: usize,
}

impl Watchers {
    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size the table for `num_blocks` blocks (a no-op once sized). Errors: the allocation
    /// failed ([`Error::Memory`]), nothing changed.
    fn reserve(&mut self, num_blocks: usize) -> Result<()> {
        if self.by_block.len() < num_blocks {
            self.by_block = Error::try_vec("the reuse watchers", num_blocks, (0, 0))?;
        }
        Ok(())
    }

    /// Watch block `b` (below the size [`Watchers::reserve`] made) for `watcher`: a block
    /// watched already keeps its order and takes the new watcher, a new one the next order.
    fn register(&mut self, b: u32, watcher: u64, seq: &mut u64) {
        if let Some(e) = self.by_block.get_mut(b as usize) {
            if e.0 == 0 {
                *seq += 1;
                *e = (*seq, watcher);
                self.len += 1;
            } else {
                e.1 = watcher;
            }
        }
    }

    /// Block `b`'s `(order, watcher)`, forgotten.
    fn remove(&mut self, b: u32) -> Option<(u64, u64)> {
        let e = self.by_block.get_mut(b as usize)?;
        if e.0 == 0 {
            return None;
        }
        self.len -= 1;
        Some(std::mem::take(e))
    }

    /// The watched blocks and their `(order, watcher)`, by block id.
    fn iter(&self) -> impl Iterator<Item = (u32, (u64, u64))> + '_ {
        self.by_block.iter().enumerate().filter(|(_, e)| e.0 != 0).map(|(b, &e)| (b as u32, e))
    }

    /// Forget every watcher (the table keeps its size).
    fn clear(&mut self) {
        if self.len > 0 {
            self.by_block.iter_mut().for_each(|e| *e = (0, 0));
            self.len = 0;
        }
    }
}

/// The block pool.
#[derive(Clone)]
pub struct BlockPool {
    num_blocks: usize,
    enable_caching: bool,
    hash_block_size: usize,
    num_hash_lookahead_tokens: usize,
    /// Per block, the fields one allocation, eviction or caching reads together.
    meta: Vec<BlockMeta>,
    /// Further keys of a block: `(slot, overflow node)`, in insertion order.
    secondary: HashMap<u32, Vec<(u32, u32)>>,
    /// `unpin_blocks` reuse watchers: block -> (order of first registration, caller's watcher
    /// id). vLLM keeps them in a dict: re-registering a block keeps its place, a fired one
    /// loses it; a reset fires them in that order.
    watchers: Watchers,
    /// The next registration order of `watchers`.
    watcher_seq: u64,
    /// Watchers that fired (block, watcher id), for the caller to notify.
    fired: Vec<(u32, u64)>,
    queue: FreeQueue,
    map: CacheMap,
    events_enabled: bool,
    events: Vec<Event>,
    /// The medium its events report.
    medium: Medium,
    /// With a shared queue, each event's tick on the process-wide event clock (parallel to
    /// `events`), so another pool's events merge into this one's in recording order.
    ticks: Option<Vec<u64>>,
    scratch: Vec<u32>,
    scratch2: Vec<u32>,
    /// Reused buffers of the per-block paths (no allocation per call): the keys one
    /// `cache_full_blocks` call adds, the keys one eviction removes.
    scratch_keys: Vec<(u32, Digest, usize, u32)>,
    scratch_removed: Vec<Key>,
    /// Priority retention (None: plain LRU, vLLM's order).
    retention: Option<Box<Retention>>,
    /// KV-cache residency metrics (vLLM's `metrics_collector`; None: off).
    residency: Option<Box<Residency>>,
}

impl BlockPool {
    /// `BlockPool(num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events)`:
    /// every block free in id order, then block 0 taken as the null block.
    pub fn new(
        num_blocks: usize,
        enable_caching: bool,
        hash_block_size: usize,
        enable_kv_cache_events: bool,
    ) -> Result<Self> {
        if num_blocks == 0 {
            return Err(Error::value("num_gpu_blocks", "must be > 0 (block 0 is the null block)"));
        }
        if num_blocks > i32::MAX as usize {
            return Err(Error::value("num_gpu_blocks", format!("{num_blocks} exceeds the int32 block-id range")));
        }
        if hash_block_size == 0 {
            return Err(Error::value("hash_block_size", "must be > 0"));
        }
        let mut queue = FreeQueue::new(num_blocks)?;
        queue.popleft()?; // the null block
        Ok(BlockPool {
            num_blocks,
            enable_caching,
            hash_block_size,
            num_hash_lookahead_tokens: 0,
            meta: Error::try_vec("the block arena", num_blocks, BlockMeta::FREE)?,
            secondary: HashMap::new(),
            watchers: Watchers::default(),
            watcher_seq: 0,
            fired: Vec::new(),
            queue,
            map: CacheMap::new(num_blocks, if enable_caching { num_blocks } else { 0 })?,
            events_enabled: enable_kv_cache_events,
            events: Vec::new(),
            medium: Medium::Device,
            ticks: None,
            scratch: Vec::new(),
            scratch2: Vec::new(),
            scratch_keys: Vec::new(),
            scratch_removed: Vec::new(),
            retention: None,
            residency: None,
        })
    }

    /// Turn KV-cache residency metrics on (vLLM's `metrics_collector`, see
    /// [`crate::pool::residency`]): from now on the pool samples the blocks it hands out at
    /// `sample_rate`, records hits on them and an event when a sampled block is evicted.
    /// Replaces the metrics it had.
    pub fn enable_residency(&mut self, sample_rate: f64, seed: u64) -> Result<()> {
        self.residency = Some(Box::new(Residency::new(self.num_blocks, sample_rate, seed)?));
        Ok(())
    }

    /// Put back residency metrics taken from a pool of the same size (a rebuilt pool keeps its
    /// collector's rate, generator and pending events). Errors, changing nothing, when `r` was
    /// made for another number of blocks.
    pub fn restore_residency(&mut self, r: Residency) -> Result<()> {
        if r.num_blocks() != self.num_blocks {
            return Err(Error::Value(format!(
                "residency metrics of {} blocks for a pool of {}",
                r.num_blocks(),
                self.num_blocks
            )));
        }
        self.residency = Some(Box::new(r));
        Ok(())
    }

    /// Turn residency metrics off (their state is dropped).
    pub fn disable_residency(&mut self) {
        self.residency = None;
    }

    /// The residency metrics, if on.
    pub fn residency(&self) -> Option<&Residency> {
        self.residency.as_deref()
    }

    /// The residency metrics, if on, for changes from outside the pool's transitions (vLLM
    /// code calling the collector's hooks or editing `block_metrics`).
    pub fn residency_mut(&mut self) -> Option<&mut Residency> {
        self.residency.as_deref_mut()
    }

    /// Turn priority retention on ([`crate::pool::retention`]): the free queue becomes one
    /// list per level. Only before any block was cached (the pool as built).
    pub fn enable_retention(&mut self, default_priority: u8, granularity_s: f64) -> Result<()> {
        if self.retention.is_some() {
            return Err(Error::State("retention is already on".into()));
        }
        if !self.map.is_empty() || self.num_free_blocks() + 1 != self.num_blocks {
            return Err(Error::State("retention can only be turned on for a fresh pool".into()));
        }
        let r = Retention::new(self.num_blocks, default_priority, granularity_s)?;
        self.queue.set_levels(NUM_LEVELS)?;
        self.retention = Some(Box::new(r));
        Ok(())
    }

    /// The retention state, if on.
    pub fn retention(&self) -> Option<&Retention> {
        self.retention.as_deref()
    }

    /// Read the clock (seconds, any origin, non-decreasing for sensible decay): free blocks
    /// whose priority ran out move to the default level's tail, in expiry order. No-op with
    /// retention off; a time that is not finite (NaN, inf) is refused, changing nothing,
    /// whether retention is on or not.
    pub fn set_time(&mut self, now_s: f64) -> Result<()> {
        if !now_s.is_finite() {
            return Err(Error::value("now_s", format!("{now_s} is not a finite time")));
        }
        let Some(r) = self.retention.as_deref_mut() else { return Ok(()) };
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        r.advance(now_s, &mut out)?;
        let level = 1 + r.default_priority() as usize;
        for &b in &out {
            if self.queue.contains(b) {
                self.queue.remove(b)?;
                self.queue.append_at(b, level);
            }
        }
        self.scratch = out;
        Ok(())
    }

    /// A holder of (valid, in-use) block `b` asks for retention priority `p` (0–100) for
    /// `duration_s` seconds after release (None: for good); see [`Retention::assign`]. No-op
    /// with retention off or for the null block.
    pub fn assign_retention(&mut self, b: u32, p: u8, duration_s: Option<f64>) {
        if let Some(r) = self.retention.as_deref_mut() {
            if b != NULL_BLOCK && self.meta[b as usize].ref_cnt > 0 {
                r.assign(b, p, duration_s);
            }
        }
    }

    /// A block's generation (see [`BlockPool::generation_of`] users: stale-hit checks).
    pub fn generation(&self, b: u32) -> Result<u32> {
        self.check_id(b)?;
        Ok(self.meta[b as usize].generation)
    }

    /// A valid block's generation.
    #[inline(always)]
    pub fn generation_of(&self, b: u32) -> u32 {
        self.meta[b as usize].generation
    }

    /// Set `num_hash_lookahead_tokens` (tokens after each block covered by its hash; events
    /// report them).
    pub fn set_num_hash_lookahead_tokens(&mut self, n: usize) {
        self.num_hash_lookahead_tokens = n;
    }

    /// Tokens after each block covered by its hash.
    pub fn num_hash_lookahead_tokens(&self) -> usize {
        self.num_hash_lookahead_tokens
    }

    /// Number of blocks, the null block included.
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Whether prefix caching is on.
    #[inline]
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    /// The hash granularity in tokens.
    #[inline]
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// Whether KV events are recorded.
    pub fn events_enabled(&self) -> bool {
        self.events_enabled
    }

    /// `get_num_free_blocks()`: free blocks, cached-but-free ones included.
    #[inline]
    pub fn num_free_blocks(&self) -> usize {
        self.queue.len()
    }

    /// `get_usage()`: `1 - free / (num_blocks - 1)`; 0 when only the null block exists.
    pub fn usage(&self) -> f64 {
        let total = self.num_blocks - 1;
        if total == 0 {
            return 0.0;
        }
        1.0 - self.num_free_blocks() as f64 / total as f64
    }

    /// Bytes of per-block metadata: the block's own state (reference count, primary key slot,
    /// its token count, generation), the free-queue links and the primary-key links (the hash
    /// map's own table and key slab excluded).
    pub fn bytes_per_block() -> usize {
        std::mem::size_of::<BlockMeta>() + FreeQueue::bytes_per_block() + CacheMap::bytes_per_block()
    }

    #[inline(always)]
    fn check_id(&self, b: u32) -> Result<()> {
        if (b as usize) < self.num_blocks {
            Ok(())
        } else {
            Err(Error::value("block_id", format!("{b} is out of range [0, {})", self.num_blocks)))
        }
    }

    /// Check that every id is a block of this pool.
    #[inline]
    pub fn check_ids(&self, ids: &[u32]) -> Result<()> {
        ids.iter().try_for_each(|&b| self.check_id(b))
    }

    /// A block's reference count.
    pub fn ref_cnt(&self, b: u32) -> Result<u32> {
        self.check_id(b)?;
        Ok(self.meta[b as usize].ref_cnt)
    }

    /// A block's reference count, for a valid id.
    #[inline(always)]
    pub fn ref_of(&self, b: u32) -> u32 {
        self.meta[b as usize].ref_cnt
    }

    /// Set a block's reference count (vLLM code writes `block.ref_cnt` directly, e.g. to
    /// retain both ends of a copy-on-write copy). The free queue is not touched, so the
    /// count may only change between positive values, or to 0 for a block in the queue.
    pub fn set_ref_cnt(&mut self, b: u32, v: u32) -> Result<()> {
        self.check_id(b)?;
        if b == NULL_BLOCK {
            self.meta[0].ref_cnt = v; // never maintained, as in vLLM
            return Ok(());
        }
        let queued = self.queue.contains(b);
        if (v == 0) != queued {
            return Err(Error::State(format!(
                "block {b}: ref_cnt {v} would disagree with the free queue (the block is {}in it); \
                 use touch / free_blocks to take or drop references",
                if queued { "" } else { "not " }
            )));
        }
        self.meta[b as usize].ref_cnt = v;
        Ok(())
    }

    /// Number of these (valid) blocks that are free, the null block not counted.
    pub fn count_free(&self, ids: &[u32]) -> usize {
        ids.iter().filter(|&&b| b != NULL_BLOCK && self.meta[b as usize].ref_cnt == 0).count()
    }

    /// A block's primary cache key (vLLM's `block.block_hash`), if it has one.
    pub fn block_key(&self, b: u32) -> Result<Option<Key>> {
        self.check_id(b)?;
        Ok(self.key_of_block(b))
    }

    #[inline(always)]
    fn key_of_block(&self, b: u32) -> Option<Key> {
        let s = self.meta[b as usize].key_slot;
        (s != NO_KEY).then(|| self.map.key_of(s))
    }

    /// True if the (valid) block has a primary key.
    #[inline(always)]
    pub fn has_hash(&self, b: u32) -> bool {
        self.meta[b as usize].key_slot != NO_KEY
    }

    /// `block_hash_num_tokens`: the prefix length the primary key covers.
    pub fn block_hash_num_tokens(&self, b: u32) -> Result<Option<usize>> {
        self.check_id(b)?;
        let t = self.meta[b as usize].key_tokens;
        Ok((t != NO_TOKENS).then_some(t as usize))
    }

    /// The further keys of a block (vLLM's `cached_block_hashes_by_block[block_id]`).
    pub fn secondary_keys(&self, b: u32) -> Vec<Key> {
        self.secondary.get(&b).map(|v| v.iter().map(|&(s, _)| self.map.key_of(s)).collect()).unwrap_or_default()
    }

    /// Blocks that have further keys, with them.
    pub fn secondary_items(&self) -> Vec<(u32, Vec<Key>)> {
        self.secondary.keys().map(|&b| (b, self.secondary_keys(b))).collect()
    }

    /// The free-queue level of a free block (0 with retention off; with it on, 0 for blocks
    /// without a hash, `1 + priority` for cached ones).
    pub fn queue_level(&self, b: u32) -> usize {
        self.queue.level_of(b)
    }

    /// True if the block is in the free queue.
    pub fn is_free(&self, b: u32) -> bool {
        self.queue.contains(b)
    }

    /// The free queue, head (next to allocate) first.
    pub fn free_queue(&self) -> impl Iterator<Item = u32> + '_ {
        self.queue.iter()
    }

    /// A free block's neighbours in the queue (`prev_free_block`, `next_free_block`), `None`
    /// for a sentinel end or a block not in the queue; `(None, None)` and false when not
    /// linked.
    pub fn queue_neighbours(&self, b: u32) -> (Option<u32>, Option<u32>, bool) {
        let (p, n) = self.queue.links(b);
        if n == UNLINKED {
            return (None, None, false);
        }
        let real = |x: u32| ((x as usize) < self.num_blocks).then_some(x);
        (real(p), real(n), true)
    }

    /// The first and last free blocks (the sentinels' neighbours).
    pub fn queue_ends(&self) -> (Option<u32>, Option<u32>) {
        (self.queue.front(), self.queue.back())
    }

    /// The hash -> block map.
    pub fn cache_map(&self) -> &CacheMap {
        &self.map
    }

    /// The first block cached under `(hash, group)`.
    #[inline]
    pub fn lookup(&self, hash: &Digest, group: u32) -> Option<u32> {
        self.map.get_one(&Key { hash: *hash, group })
    }

    /// [`BlockPool::lookup`] for raw digest bytes.
    #[inline]
    pub fn lookup_bytes(&self, hash: &[u8], group: u32) -> Option<u32> {
        self.map.get_one_bytes(hash, group)
    }

    /// Start loading the table buckets [`BlockPool::get_cached_block`] reads for `hash` in
    /// `groups` (a hint: see [`crate::prefetch`]).
    #[inline]
    pub fn prefetch_lookup(&self, hash: &[u8], groups: &[u32]) {
        for &g in groups {
            self.map.prefetch_bytes(hash, g);
        }
    }

    /// `get_cached_block`: one block per group, or `None` if any group misses.
    #[inline]
    pub fn get_cached_block(&self, hash: &[u8], groups: &[u32], out: &mut Vec<u32>) -> bool {
        out.clear();
        for &g in groups {
            match self.map.get_one_bytes(hash, g) {
                Some(b) => out.push(b),
                None => return false,
            }
        }
        true
    }

    /// `_remove_cached_block_hashes`: drop every key of block `b` (primary first, then the
    /// further ones) and reset its hash; the keys that were in the map (attached) are
    /// returned, for `BlockRemoved` events.
    fn remove_cached_block_hashes(&mut self, b: u32, removed: &mut Vec<Key>) {
        let s = self.meta[b as usize].key_slot;
        if s != NO_KEY {
            self.meta[b as usize].key_slot = NO_KEY;
            self.meta[b as usize].key_tokens = NO_TOKENS;
            if let Some((key, true)) = self.map.remove(s, b) {
                removed.push(key);
            }
        }
        // further keys are rare (partial-prefix entries): most pools never hash a lookup here
        let more = if self.secondary.is_empty() { None } else { self.secondary.remove(&b) };
        if let Some(more) = more {
            for (slot, node) in more {
                if let Some((key, true)) = self.map.remove(slot, node) {
                    removed.push(key);
                }
            }
        }
    }

    fn emit_removed(&mut self, removed: &[Key]) {
        if self.events_enabled {
            for k in removed {
                let e = Event::BlockRemoved { block_hash: k.hash, group: k.group, medium: self.medium };
                self.record(e);
            }
        }
    }

    /// `_maybe_evict_cached_block`: drop the block's keys (one `BlockRemoved` each); false if
    /// it had none in the map.
    pub fn maybe_evict_cached_block(&mut self, b: u32) -> Result<bool> {
        self.check_id(b)?;
        if let Some(r) = self.residency.as_deref_mut() {
            // vLLM reports every block it evicts this way, with or without a hash
            r.on_evicted(b, now_ns());
        }
        Ok(self.evict(b))
    }

    #[inline]
    fn evict(&mut self, b: u32) -> bool {
        if self.meta[b as usize].key_slot == NO_KEY && (self.secondary.is_empty() || !self.secondary.contains_key(&b)) {
            return false;
        }
        let mut removed = std::mem::take(&mut self.scratch_removed);
        removed.clear();
        self.remove_cached_block_hashes(b, &mut removed);
        self.emit_removed(&removed);
        let any = !removed.is_empty();
        self.scratch_removed = removed;
        any
    }

    /// `_insert_block_hash`: key `key` for block `b` (primary if it has none, else a further
    /// key), unless it already holds it. `tag`: the key's table tag, when the caller has it.
    fn insert_block_hash(&mut self, key: Key, tag: Option<u32>, b: u32, num_tokens: Option<usize>) {
        let s = self.meta[b as usize].key_slot;
        if s != NO_KEY && self.map.key_of(s) == key {
            return;
        }
        if s == NO_KEY {
            // the block's primary key: one probe skips a key the block holds as a further
            // key already, or finds where the key goes
            if let Some(slot) = self.map.insert_unless_held(key, tag, b) {
                self.meta[b as usize].key_slot = slot;
                self.meta[b as usize].key_tokens = num_tokens.map_or(NO_TOKENS, |t| t as u32);
            }
            return;
        }
        if self.map.contains(&key, b) {
            return;
        }
        let node = self.map.new_overflow_node(b);
        let slot = self.map.insert_node(key, node);
        self.secondary.entry(b).or_default().push((slot, node));
    }

    /// `get_new_blocks(n)`: pop `n` blocks from the head, evicting cached ones, each with
    /// `ref_cnt = 1`, appended to `out`. Fails, changing nothing, if fewer than `n` are free.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<u32>) -> Result<()> {
        if n > self.queue.len() {
            return Err(Error::NotEnoughFreeBlocks { requested: n, free: self.queue.len() });
        }
        let start = out.len();
        self.queue.popleft_n(n, out)?;
        if self.enable_caching && n > 1 {
            // The LRU blocks handed out are rarely in cache: start loading all their key
            // entries before evicting them one by one.
            for &b in &out[start..] {
                let s = self.meta[b as usize].key_slot;
                if s != NO_KEY {
                    self.map.prefetch_slot(s);
                }
            }
        }
        if let Some(&b) = out[start..].iter().find(|&&b| self.meta[b as usize].ref_cnt != 0) {
            // a block in use was put in the queue by a raw free-queue call: handing it out
            // would give it two owners; put the popped blocks back where they were
            self.queue.restore_front(&out[start..]);
            out.truncate(start);
            return Err(Error::State(format!(
                "block {b} is in the free queue but in use (put there by a raw free-queue call)"
            )));
        }
        if !self.watchers.is_empty() {
            for &b in &out[start..] {
                if let Some((_, w)) = self.watchers.remove(b) {
                    self.fired.push((b, w));
                }
            }
        }
        // the table buckets of the evicted keys: started a few blocks ahead, once the entries
        // holding their tags have had time to arrive
        const AHEAD: usize = 4;
        let bucket_ahead = |pool: &Self, i: usize| {
            if let Some(&b) = out.get(i) {
                let s = pool.meta[b as usize].key_slot;
                if s != NO_KEY {
                    pool.map.prefetch_slot_bucket(s);
                }
            }
        };
        for (i, &b) in out.iter().enumerate().skip(start) {
            if self.enable_caching {
                if n > 1 {
                    bucket_ahead(self, i + AHEAD);
                }
                self.evict(b);
            }
            self.meta[b as usize].ref_cnt = 1;
            let g = &mut self.meta[b as usize].generation;
            *g = g.wrapping_add(1);
        }
        if let Some(r) = self.residency.as_deref_mut() {
            // vLLM: with caching on, each block handed out is reported evicted (whether or not
            // it was cached), then allocated; with caching off, allocated only. One clock
            // read for the call.
            let now = now_ns();
            for &b in &out[start..] {
                if self.enable_caching {
                    r.on_evicted(b, now);
                }
                r.on_allocated(b, now);
            }
        }
        if let Some(r) = self.retention.as_deref_mut() {
            for &b in &out[start..] {
                r.reset(b);
            }
        }
        Ok(())
    }

    /// `touch(blocks)`: take a reference on each block; a free (cached) block leaves the queue.
    /// The null block is skipped when `skip_null`, else rejected.
    pub fn touch(&mut self, ids: &[u32], skip_null: bool) -> Result<()> {
        for &b in ids {
            self.check_id(b)?;
            if b == NULL_BLOCK && !skip_null {
                return Err(Error::value("block_ids", "cannot touch the null block"));
            }
            if b != NULL_BLOCK && self.meta[b as usize].ref_cnt == 0 && !self.queue.contains(b) {
                return Err(Error::State(format!("block {b} has ref_cnt 0 but is not in the free queue")));
            }
        }
        for &b in ids {
            if b == NULL_BLOCK {
                continue;
            }
            if self.meta[b as usize].ref_cnt == 0 {
                self.queue.remove(b)?;
                if let Some(r) = self.retention.as_deref_mut() {
                    r.unlink_bucket(b);
                }
            }
            self.meta[b as usize].ref_cnt += 1;
        }
        if let Some(r) = self.residency.as_deref_mut() {
            let now = now_ns();
            for &b in ids {
                if b != NULL_BLOCK {
                    r.on_accessed(b, now);
                }
            }
        }
        Ok(())
    }

    /// Give back the references `free_blocks` took from `ids` before it failed.
    fn undo_decrements(&mut self, ids: &[u32]) {
        for &r in ids {
            if r != NULL_BLOCK {
                self.meta[r as usize].ref_cnt += 1;
            }
        }
    }

    /// `free_blocks(ordered_blocks)`: drop one reference per listed block (null skipped when
    /// `skip_null`). Blocks reaching 0 are queued: unhashed ones (or all, with caching off)
    /// prepended to the head in the given order, hashed ones appended to the tail in the given
    /// order. Dropping more references than a block holds fails and changes nothing.
    pub fn free_blocks(&mut self, ids: &[u32], skip_null: bool) -> Result<()> {
        self.free_blocks_ordered(ids, skip_null, false)
    }

    /// [`BlockPool::free_blocks`], and with `evict_first` (vLLM 0.34's
    /// `free_blocks(..., evict_first=True)`, for blocks another tier already holds) hashed
    /// blocks reaching 0 go to the head with the unhashed ones, in the given order: they are
    /// evicted before every other cached block, and keep their keys until then.
    pub fn free_blocks_ordered(&mut self, ids: &[u32], skip_null: bool, evict_first: bool) -> Result<()> {
        for &b in ids {
            self.check_id(b)?;
            if b == NULL_BLOCK && !skip_null {
                return Err(Error::value("block_ids", "cannot free the null block"));
            }
        }
        // Decrement in order; a block reaches 0 at its last occurrence and is queued once.
        // A block freed more often than it is referenced rolls everything back.
        let mut reached = std::mem::take(&mut self.scratch);
        reached.clear();
        for (i, &b) in ids.iter().enumerate() {
            if b == NULL_BLOCK {
                continue;
            }
            let rc = &mut self.meta[b as usize].ref_cnt;
            if *rc == 0 {
                self.undo_decrements(&ids[..i]);
                self.scratch = reached;
                return Err(over_freed(ids, i, b));
            }
            *rc -= 1;
            if *rc == 0 {
                if self.queue.contains(b) {
                    // queued while in use (a raw free-queue call): queuing it again would
                    // corrupt the queue
                    self.undo_decrements(&ids[..=i]);
                    self.scratch = reached;
                    return Err(Error::State(format!(
                        "block {b} is already in the free queue although it was in use (put there by a raw free-queue call)"
                    )));
                }
                reached.push(b);
            }
        }
        // Unhashed blocks (all of them with caching off) go to the head, hashed ones to the
        // tail, each group in the given order.
        if self.enable_caching && !evict_first && reached.iter().any(|&b| self.meta[b as usize].key_slot != NO_KEY) {
            let mut unhashed = std::mem::take(&mut self.scratch2);
            unhashed.clear();
            for &b in &reached {
                if self.meta[b as usize].key_slot != NO_KEY {
                    match self.retention.as_deref_mut() {
                        Some(r) => self.queue.append_at(b, r.release_level(b)),
                        None => self.queue.append(b),
                    }
                } else {
                    unhashed.push(b);
                }
            }
            self.queue.prepend_n(&unhashed);
            self.scratch2 = unhashed;
        } else {
            self.queue.prepend_n(&reached);
        }
        self.scratch = reached;
        Ok(())
    }

    /// `unpin_blocks(blocks, on_reuse)`: drop a reference on each block (each must hold one,
    /// the null block is refused); blocks reaching 0 join the tail of the free queue whatever
    /// their hash. `watcher` is recorded for every block: it fires when `get_new_blocks` hands
    /// the block out or the cache is reset ([`BlockPool::take_fired_watchers`]).
    pub fn unpin_blocks(&mut self, ids: &[u32], watcher: u64) -> Result<()> {
        for &b in ids {
            self.check_id(b)?;
            if b == NULL_BLOCK {
                return Err(Error::Assertion("unpin_blocks: the null block is never pinned".into()));
            }
        }
        // a block listed twice releases two references: counted in a map, except for the
        // one block the residency's every call names
        let short = if let &[b] = ids {
            (self.meta[b as usize].ref_cnt < 1).then_some(b)
        } else {
            let mut need: HashMap<u32, u32> = HashMap::new();
            for &b in ids {
                *need.entry(b).or_default() += 1;
            }
            need.iter().find(|(&b, &n)| self.meta[b as usize].ref_cnt < n).map(|(&b, _)| b)
        };
        if let Some(b) = short {
            return Err(Error::Assertion(format!("unpin_blocks: block {b} holds fewer references than released")));
        }
        // the watchers' table is sized for the pool on the first registration, before anything
        // changes (a failed allocation leaves the pool as it was)
        self.watchers.reserve(self.num_blocks)?;
        self.release_watched(ids, watcher);
        Ok(())
    }

    /// Drop one reference of each of `ids` (checked), watching each for reuse by `watcher`;
    /// the blocks left unreferenced go to the free queue's tail, in order.
    fn release_watched(&mut self, ids: &[u32], watcher: u64) {
        let mut released = Vec::new();
        for &b in ids {
            self.meta[b as usize].ref_cnt -= 1;
            self.watchers.register(b, watcher, &mut self.watcher_seq);
            if self.meta[b as usize].ref_cnt == 0 {
                released.push(b);
            }
        }
        self.queue.append_n(&released);
    }

    /// True if a watcher fired since the last take.
    pub fn has_fired_watchers(&self) -> bool {
        !self.fired.is_empty()
    }

    /// Watchers fired since the last call: `(block, watcher id)`, in firing order.
    pub fn take_fired_watchers(&mut self) -> Vec<(u32, u64)> {
        std::mem::take(&mut self.fired)
    }

    /// The watchers other than `watcher` fired since the last take, `(block, watcher id)` in
    /// firing order; `watcher`'s entries stay for [`BlockPool::take_fired_watchers_of`].
    pub fn take_fired_watchers_except(&mut self, watcher: u64) -> Vec<(u32, u64)> {
        if !self.fired.iter().any(|&(_, w)| w == watcher) {
            return std::mem::take(&mut self.fired);
        }
        let mut out = Vec::new();
        self.fired.retain(|&e| {
            if e.1 == watcher {
                true
            } else {
                out.push(e);
                false
            }
        });
        out
    }

    /// The blocks whose watcher `watcher` fired since the last take, in firing order; the
    /// other watchers' entries stay for [`BlockPool::take_fired_watchers`].
    pub fn take_fired_watchers_of(&mut self, watcher: u64) -> Vec<u32> {
        if !self.fired.iter().any(|&(_, w)| w == watcher) {
            return Vec::new();
        }
        let mut out = Vec::new();
        self.fired.retain(|&(b, w)| {
            if w == watcher {
                out.push(b);
                false
            } else {
                true
            }
        });
        out
    }

    /// The recorded reuse watchers, `(block, watcher id)` in the order the blocks were first
    /// registered (vLLM's `_reuse_watchers` dict order).
    pub fn watched_blocks(&self) -> Vec<(u32, u64)> {
        let mut v: Vec<_> = self.watchers.iter().map(|(b, (order, w))| (order, b, w)).collect();
        v.sort_unstable();
        v.into_iter().map(|(_, b, w)| (b, w)).collect()
    }

    /// True if some reuse watcher is recorded.
    pub fn has_watchers(&self) -> bool {
        !self.watchers.is_empty()
    }

    /// Refuse (`Error::Value` naming `arg`) a block listed twice among those
    /// [`BlockPool::cache_full_blocks`] would key for the same arguments (`table[num_cached..
    /// num_full]`, null blocks and those `mask` rules out aside): kvblock's own API keys each
    /// block once per call. vLLM's `cache_full_blocks` takes the later listing as the
    /// promotion of the key the earlier one just gave (one `BlockRemoved`, and a
    /// `BlockStored` that reports both keys), which its callers rely on never happening.
    /// Changes nothing; arguments `cache_full_blocks` would refuse are left to it.
    pub fn check_distinct_blocks(
        &mut self,
        table: &[u32],
        num_cached: usize,
        num_full: usize,
        mask: Option<&[bool]>,
        arg: &str,
    ) -> Result<()> {
        let end = num_full.min(table.len());
        if end.saturating_sub(num_cached) < 2 {
            return Ok(());
        }
        let keep = |i: usize| table[i] != NULL_BLOCK && mask.is_none_or(|m| m.get(i - num_cached) != Some(&false));
        let mut seen = std::mem::take(&mut self.scratch);
        seen.clear();
        seen.extend((num_cached..end).filter(|&i| keep(i)).map(|i| table[i]));
        seen.sort_unstable();
        let repeated = seen.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]);
        self.scratch = seen;
        let Some(b) = repeated else { return Ok(()) };
        let mut at = (num_cached..end).filter(|&i| keep(i) && table[i] == b);
        let (i, j) = (at.next().unwrap_or(num_cached), at.next().unwrap_or(num_cached));
        Err(Error::value(arg, format!("block {b} is listed twice (at {i} and {j}); one call caches each block once")))
    }

    /// `cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
    /// kv_cache_group_id, block_mask)`: key blocks `table[num_cached..num_full]` under the
    /// request's hashes at `block_size` (`hashes`, already viewed at that size), skipping null
    /// blocks and those `mask` (aligned with the range) rules out. A block that already has a
    /// shorter (partial) key loses its keys first (`BlockRemoved`). With events on, one
    /// `BlockStored` covers the range. Everything is checked before anything changes.
    #[allow(clippy::too_many_arguments)] // vLLM's cache_full_blocks arguments, plus the event tag
    pub fn cache_full_blocks(
        &mut self,
        table: &[u32],
        num_cached: usize,
        num_full: usize,
        hashes: &dyn HashSource,
        block_size: usize,
        group: u32,
        mask: Option<&[bool]>,
        tag: u64,
    ) -> Result<()> {
        if num_cached >= num_full {
            return Ok(());
        }
        if num_full > table.len() {
            return Err(Error::value(
                "num_full_blocks",
                format!("{num_full} exceeds the {} blocks given", table.len()),
            ));
        }
        if num_full > hashes.len() {
            return Err(Error::value(
                "num_full_blocks",
                format!("{num_full} exceeds the request's {} block hashes at block size {block_size}", hashes.len()),
            ));
        }
        if let Some(m) = mask {
            if m.len() != num_full - num_cached {
                return Err(Error::Assertion(format!(
                    "block_mask has {} entries for {} blocks",
                    m.len(),
                    num_full - num_cached
                )));
            }
        }
        let keep = |i: usize| mask.is_none_or(|m| m[i - num_cached]);
        let mut keys = std::mem::take(&mut self.scratch_keys);
        keys.clear();
        // a prefill caches tens of blocks whose hashes and key entries are rarely in cache:
        // start loading them a few blocks ahead, so that their misses overlap
        const AHEAD: usize = 4;
        let ahead = |pool: &Self, i: usize| {
            if i < num_full {
                hashes.prefetch(i);
                if let Some(&b) = table.get(i) {
                    if let Some(k) = pool.meta.get(b as usize).map(|m| &m.key_slot) {
                        crate::prefetch::prefetch(k);
                    }
                }
            }
        };
        if num_full - num_cached > 1 {
            for i in num_cached..num_cached + AHEAD {
                ahead(self, i);
            }
        }
        for (i, &b) in table.iter().enumerate().take(num_full).skip(num_cached) {
            if num_full - num_cached > 1 {
                ahead(self, i + AHEAD);
            }
            self.check_id(b)?;
            if b == NULL_BLOCK || !keep(i) {
                continue;
            }
            let num_tokens = (i + 1) * block_size;
            if self.meta[b as usize].key_slot != NO_KEY {
                let t = self.meta[b as usize].key_tokens;
                // the only block that can already have a key is a partial entry being
                // promoted to the full block
                if t == NO_TOKENS || t as usize >= num_tokens {
                    return Err(Error::Assertion(format!(
                        "block {b} already holds a key covering {} tokens; cannot cache it for {num_tokens}",
                        if t == NO_TOKENS { "an unknown number of".to_string() } else { t.to_string() }
                    )));
                }
            }
            let key = Key { hash: hashes.digest(i)?, group };
            // its table bucket, loading while the other keys are gathered
            let tag = self.map.prefetch_key(&key);
            keys.push((b, key.hash, num_tokens, tag));
        }
        let parent = if self.events_enabled && num_cached > 0 { Some(hashes.digest(num_cached - 1)?) } else { None };
        let mut stored = Vec::new();
        let mut removed = Vec::new();
        for &(b, hash, num_tokens, tag) in &keys {
            if self.meta[b as usize].key_slot != NO_KEY {
                removed.clear();
                self.remove_cached_block_hashes(b, &mut removed);
                self.emit_removed(&removed);
            }
            self.insert_block_hash(Key { hash, group }, Some(tag), b, Some(num_tokens));
            if self.events_enabled {
                stored.push(hash);
            }
        }
        if self.events_enabled {
            let key_ranges = keys.iter().map(|&(_, _, t, _)| (t - block_size, t)).collect();
            self.record(Event::BlockStored {
                block_hashes: stored,
                parent_block_hash: parent,
                token_start: num_cached * block_size,
                token_end: num_full * block_size,
                block_size,
                group,
                key_ranges,
                tag,
                medium: self.medium,
            });
        }
        self.scratch_keys = keys;
        Ok(())
    }

    /// `emit_cached_block_events(request, num_cached_blocks, block_size, kv_cache_group_id)`:
    /// a `BlockStored` for the first `num_cached` blocks of a prefix hit (parent None, tokens
    /// from 0); nothing changes. `hashes` is viewed at `block_size`.
    pub fn emit_cached_block_events(
        &mut self,
        hashes: &dyn HashSource,
        num_cached: usize,
        block_size: usize,
        group: u32,
        tag: u64,
    ) -> Result<()> {
        if !self.events_enabled || num_cached == 0 {
            return Ok(());
        }
        let block_hashes = (0..num_cached).map(|i| hashes.digest(i)).collect::<Result<Vec<_>>>()?;
        self.record(Event::BlockStored {
            block_hashes,
            parent_block_hash: None,
            token_start: 0,
            token_end: num_cached * block_size,
            block_size,
            group,
            key_ranges: (0..num_cached).map(|i| (i * block_size, (i + 1) * block_size)).collect(),
            tag,
            medium: self.medium,
        });
        Ok(())
    }

    /// `cache_partial_block(request, block, num_tokens, kv_cache_group_id, block_size,
    /// replace_existing_hashes)`: make block `b` reachable from the prefix boundary at
    /// `num_tokens` (a positive multiple of the hash block size, within the request's
    /// `hashes`): key `hashes[num_tokens / H - 1]` becomes its primary key if it has none, else
    /// a further key; a shorter primary key it had (or, with `replace`, every key) is dropped
    /// first. Returns the key, or `None` for the null block.
    #[allow(clippy::too_many_arguments)] // vLLM's cache_partial_block arguments, plus the event tag
    pub fn cache_partial_block(
        &mut self,
        b: u32,
        hashes: &dyn HashSource,
        num_tokens: usize,
        group: u32,
        block_size: usize,
        replace: bool,
        tag: u64,
    ) -> Result<Option<Key>> {
        self.check_id(b)?;
        if b == NULL_BLOCK {
            return Ok(None);
        }
        let h = self.hash_block_size;
        if !block_size.is_multiple_of(h) {
            return Err(Error::Assertion(format!("block_size {block_size} is not a multiple of {h}")));
        }
        if !num_tokens.is_multiple_of(h) {
            return Err(Error::Assertion(format!("num_tokens {num_tokens} is not a multiple of {h}")));
        }
        let n_hash = num_tokens / h;
        if n_hash == 0 || n_hash > hashes.len() {
            return Err(Error::Assertion(format!(
                "num_tokens {num_tokens} is outside the request's {} block hashes",
                hashes.len()
            )));
        }
        let key = Key { hash: hashes.digest(n_hash - 1)?, group };
        let parent = if self.events_enabled && n_hash > 1 { Some(hashes.digest(n_hash - 2)?) } else { None };
        let primary = self.key_of_block(b);
        let mut already = primary == Some(key) || self.map.contains(&key, b);
        let mut removed = Vec::new();
        if replace {
            self.remove_cached_block_hashes(b, &mut removed);
            already = false;
        } else if !already && primary.is_some() {
            let t = self.meta[b as usize].key_tokens;
            if t != NO_TOKENS && (t as usize) < n_hash * h {
                self.remove_cached_block_hashes(b, &mut removed);
            }
        }
        self.emit_removed(&removed);
        self.insert_block_hash(key, None, b, Some(n_hash * h));
        if self.events_enabled && !already {
            let start = (n_hash - 1) * h;
            self.record(Event::BlockStored {
                block_hashes: vec![key.hash],
                parent_block_hash: parent,
                token_start: start,
                token_end: num_tokens,
                block_size: num_tokens - start,
                group,
                key_ranges: vec![(start, num_tokens)],
                tag,
                medium: self.medium,
            });
        }
        Ok(Some(key))
    }

    /// `move_block_hashes(src, dst)`: re-point every key of `src` that is in the map to `dst`
    /// (which must have none); no events.
    /// The null block never holds a key (a key on it would make it a prefix hit).
    pub fn move_block_hashes(&mut self, src: u32, dst: u32) -> Result<()> {
        self.check_id(src)?;
        self.check_id(dst)?;
        self.check_can_hold_key(dst, "dst")?;
        if self.meta[dst as usize].key_slot != NO_KEY || self.secondary.contains_key(&dst) {
            return Err(Error::Assertion(format!("move_block_hashes: block {dst} already has a hash")));
        }
        let t = self.meta[src as usize].key_tokens;
        let mut removed = Vec::new();
        self.remove_cached_block_hashes(src, &mut removed);
        for key in removed {
            // the token count applies to the first (primary) insertion only
            self.insert_block_hash(key, None, dst, (t != NO_TOKENS).then_some(t as usize));
        }
        Ok(())
    }

    /// Refuse (`Error::Value` naming `arg`) the null block as a block to give a key: it never
    /// holds one (a key on it would make the manager hand it out as a prefix hit).
    #[inline]
    fn check_can_hold_key(&self, b: u32, arg: &str) -> Result<()> {
        if b == NULL_BLOCK {
            return Err(Error::value(arg, "block 0 is the null block, which cannot hold a cache key"));
        }
        Ok(())
    }

    /// `is_block_writable(block)`: not null, one reference, no hash.
    pub fn is_block_writable(&self, b: u32) -> Result<bool> {
        self.check_id(b)?;
        Ok(b != NULL_BLOCK && self.meta[b as usize].ref_cnt == 1 && self.meta[b as usize].key_slot == NO_KEY)
    }

    /// `evict_blocks(ids)`: drop the cache keys of these blocks (ref counts and queue position
    /// unchanged).
    pub fn evict_blocks(&mut self, ids: &[u32]) -> Result<()> {
        for &b in ids {
            self.check_id(b)?;
        }
        let now = if self.residency.is_some() { now_ns() } else { 0 };
        for &b in ids {
            if let Some(r) = self.residency.as_deref_mut() {
                r.on_evicted(b, now);
            }
            if self.evict(b) {
                let g = &mut self.meta[b as usize].generation;
                *g = g.wrapping_add(1);
            }
        }
        Ok(())
    }

    /// `reset_prefix_cache()`: only when every non-null block is free; clears every key, fires
    /// every reuse watcher (in the order their blocks were first registered) and records `AllBlocksCleared`. Returns false (changing nothing)
    /// otherwise.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_blocks - self.num_free_blocks() != 1 {
            return false;
        }
        self.map.clear();
        self.secondary.clear();
        let mut w: Vec<(u64, u32, u64)> = self.watchers.iter().map(|(b, (seq, w))| (seq, b, w)).collect();
        self.watchers.clear();
        w.sort_unstable();
        self.fired.extend(w.into_iter().map(|(_, b, w)| (b, w)));
        self.meta.iter_mut().for_each(|m| {
            m.key_slot = NO_KEY;
            m.key_tokens = NO_TOKENS;
        });
        if let Some(r) = self.residency.as_deref_mut() {
            r.reset();
        }
        if self.events_enabled {
            self.record(Event::AllBlocksCleared);
        }
        true
    }

    // ---- the map's and blocks' raw faces (vLLM code and tests that reach inside) ----

    /// `block.set_block_hash(key, num_tokens)`: give a block without a hash a primary key,
    /// not (yet) in the map. The null block is accepted, as vLLM's own tests key it by hand
    /// (`test_maybe_evict_cached_block`).
    pub fn set_block_hash(&mut self, b: u32, key: Key, num_tokens: Option<usize>) -> Result<()> {
        self.check_id(b)?;
        if self.meta[b as usize].key_slot != NO_KEY {
            return Err(Error::Assertion("The block already has a hash. This should not happen.".into()));
        }
        let slot = self.map.insert_detached(key, b);
        self.meta[b as usize].key_slot = slot;
        self.meta[b as usize].key_tokens = num_tokens.map_or(NO_TOKENS, |t| t as u32);
        Ok(())
    }

    /// `block.reset_hash()`: the block forgets its primary key (and leaves the map under it).
    pub fn reset_hash(&mut self, b: u32) -> Result<()> {
        self.check_id(b)?;
        let s = self.meta[b as usize].key_slot;
        if s != NO_KEY {
            self.meta[b as usize].key_slot = NO_KEY;
            self.meta[b as usize].key_tokens = NO_TOKENS;
            self.map.remove(s, b);
        }
        Ok(())
    }

    /// `cached_block_hash_to_block.insert(key, block)`: list `b` under `key` (its primary key
    /// if it has none, or the detached primary key it was given by hand; else a further key).
    /// The null block is accepted, as by vLLM's map (its own tests list it by hand).
    pub fn map_insert(&mut self, key: Key, b: u32) -> Result<()> {
        self.check_id(b)?;
        let s = self.meta[b as usize].key_slot;
        if s != NO_KEY && self.map.key_of(s) == key {
            if self.map.is_detached(s) {
                if self.map.find(&key).is_some() {
                    // join the attached key's list
                    self.map.remove(s, b);
                    self.meta[b as usize].key_slot = self.map.insert(key, b);
                } else {
                    self.map.reattach(s)?;
                }
            }
            return Ok(());
        }
        self.insert_block_hash(key, None, b, None);
        Ok(())
    }

    /// `cached_block_hash_to_block.pop(key, block_id)`: take `b` off `key`'s list; returns
    /// whether it was there. A primary key taken off leaves the block without a hash.
    pub fn map_pop(&mut self, key: Key, b: u32) -> Result<bool> {
        self.check_id(b)?;
        if !self.map.contains(&key, b) {
            return Ok(false);
        }
        let s = self.meta[b as usize].key_slot;
        if s != NO_KEY && self.map.key_of(s) == key && !self.map.is_detached(s) {
            self.meta[b as usize].key_slot = NO_KEY;
            self.meta[b as usize].key_tokens = NO_TOKENS;
            self.map.remove(s, b);
            return Ok(true);
        }
        if let Some(list) = self.secondary.get_mut(&b) {
            if let Some(pos) = list.iter().position(|&(slot, _)| self.map.key_of(slot) == key) {
                let (slot, node) = list.remove(pos);
                if list.is_empty() {
                    self.secondary.remove(&b);
                }
                self.map.remove(slot, node);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `del cached_block_hash_to_block._cache[key]` / `.pop(key)`: the key stops being found,
    /// its blocks keep it. Returns its blocks (first first), empty if it was not there.
    pub fn map_detach(&mut self, key: &Key) -> Vec<u32> {
        match self.map.detach(key) {
            Some(slot) => self.map.blocks_of_slot(slot),
            None => Vec::new(),
        }
    }

    /// `cached_block_hash_to_block._cache.clear()`: every key stops being found.
    pub fn map_detach_all(&mut self) {
        self.map.detach_all();
    }

    /// `cached_block_hash_to_block._cache[key] = value`, restoring a detached key with exactly
    /// the blocks it still has (`blocks`, first first).
    pub fn map_reattach(&mut self, key: &Key, blocks: &[u32]) -> Result<()> {
        if let Some(slot) = self.map.find(key) {
            if self.map.blocks_of_slot(slot) == blocks {
                return Ok(());
            }
        }
        let Some(slot) = self.map.detached_slot(key) else {
            return Err(Error::State(
                "kvblock's map can only restore a key popped from it with the blocks it had".into(),
            ));
        };
        if self.map.blocks_of_slot(slot) != blocks {
            return Err(Error::State(format!(
                "cannot restore the key with blocks {blocks:?}: its blocks are now {:?}",
                self.map.blocks_of_slot(slot)
            )));
        }
        self.map.reattach(slot)
    }

    /// Raw free-queue access with vLLM's `FreeKVCacheBlockQueue` semantics (no ref counting):
    /// pop `n` from the head.
    pub fn queue_popleft_n(&mut self, n: usize, out: &mut Vec<u32>) -> Result<()> {
        self.queue.popleft_n(n, out)
    }

    /// Raw free-queue access: unlink a block.
    pub fn queue_remove(&mut self, b: u32) -> Result<()> {
        self.check_id(b)?;
        self.queue.remove(b)
    }

    /// Raw free-queue access: link blocks at the tail (`append_n`) or head (`prepend_n`).
    pub fn queue_insert(&mut self, ids: &[u32], at_head: bool) -> Result<()> {
        for (i, &b) in ids.iter().enumerate() {
            self.check_id(b)?;
            if b == NULL_BLOCK || self.queue.contains(b) || ids[..i].contains(&b) {
                return Err(Error::State(format!("block {b} is already in the free queue or is the null block")));
            }
        }
        if at_head {
            self.queue.prepend_n(ids);
        } else {
            self.queue.append_n(ids);
        }
        Ok(())
    }

    /// `take_events()`: the buffered events, oldest first.
    pub fn take_events(&mut self) -> Vec<Event> {
        if let Some(t) = self.ticks.as_mut() {
            t.clear();
        }
        std::mem::take(&mut self.events)
    }

    /// Buffer one event (stamped with the event clock when the queue is shared).
    fn record(&mut self, e: Event) {
        if let Some(t) = self.ticks.as_mut() {
            t.push(next_tick());
        }
        self.events.push(e);
    }

    /// The medium this pool's `BlockStored` / `BlockRemoved` report (vLLM's `medium`).
    pub fn medium(&self) -> Medium {
        self.medium
    }

    /// Turn KV events on or off and set their medium, for a pool whose events go into another
    /// pool's queue (vLLM's `SharedEventQueueBlockPool`, built with the device pool's
    /// `enable_kv_cache_events` and `medium=CPU`); with `shared`, events are stamped so
    /// [`BlockPool::absorb_events`] keeps their order. Buffered events are dropped.
    pub fn set_event_sharing(&mut self, enabled: bool, medium: Medium, shared: bool) {
        self.events_enabled = enabled;
        self.medium = medium;
        self.events.clear();
        self.ticks = shared.then(Vec::new);
    }

    /// Move `other`'s buffered events into this pool's queue, merged in the order they were
    /// recorded (both pools' events stamped: [`BlockPool::set_event_sharing`]); unstamped ones
    /// go after this pool's. `other`'s queue is left empty.
    pub fn absorb_events(&mut self, other: &mut BlockPool) {
        if other.events.is_empty() {
            return;
        }
        let theirs = std::mem::take(&mut other.events);
        let their_ticks = other.ticks.as_mut().map(std::mem::take).unwrap_or_default();
        let Some(my_ticks) = self.ticks.as_mut() else {
            self.events.extend(theirs);
            return;
        };
        if their_ticks.len() != theirs.len() || my_ticks.last().is_none_or(|&t| their_ticks[0] > t) {
            // all of theirs came after all of ours (the common case): append
            my_ticks.extend(their_ticks.iter().copied().chain(std::iter::repeat(u64::MAX)).take(theirs.len()));
            self.events.extend(theirs);
            return;
        }
        let mine = std::mem::take(&mut self.events);
        let mine_ticks = std::mem::take(my_ticks);
        let mut events = Vec::with_capacity(mine.len() + theirs.len());
        let mut ticks = Vec::with_capacity(events.capacity());
        let (mut a, mut b) =
            (mine.into_iter().zip(mine_ticks).peekable(), theirs.into_iter().zip(their_ticks).peekable());
        loop {
            let take_a = match (a.peek(), b.peek()) {
                (Some(x), Some(y)) => x.1 <= y.1,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            let next = if take_a { a.next() } else { b.next() };
            if let Some((e, t)) = next {
                events.push(e);
                ticks.push(t);
            }
        }
        self.events = events;
        self.ticks = Some(ticks);
    }

    /// The buffered events, oldest first.
    pub fn pending_events(&self) -> &[Event] {
        &self.events
    }

    /// Number of buffered events.
    pub fn num_pending_events(&self) -> usize {
        self.events.len()
    }

    /// Append an event (vLLM code appending to `kv_event_queue` directly).
    pub fn push_event(&mut self, e: Event) {
        self.record(e);
    }

    /// Check the pool's invariants (for tests): queue membership matches `ref_cnt == 0`, keys
    /// and the map agree.
    pub fn check_invariants(&self) -> Result<()> {
        let mut free = 0;
        for b in 1..self.num_blocks as u32 {
            let in_q = self.queue.contains(b);
            if in_q != (self.meta[b as usize].ref_cnt == 0) {
                return Err(Error::State(format!(
                    "block {b}: in queue {in_q}, ref_cnt {}",
                    self.meta[b as usize].ref_cnt
                )));
            }
            free += in_q as usize;
            let s = self.meta[b as usize].key_slot;
            if s != NO_KEY && !self.map.is_detached(s) && !self.map.contains(&self.map.key_of(s), b) {
                return Err(Error::State(format!("block {b} has a key the map does not hold")));
            }
        }
        if self.queue.contains(NULL_BLOCK) || free != self.queue.len() {
            return Err(Error::State("free queue inconsistent".into()));
        }
        Ok(())
    }
}

/// The error for block `b`, found free at `ids[i]`: a block that was free before the call
/// (a double free), or one listed more often in this call than it holds references.
#[cold]
fn over_freed(ids: &[u32], i: usize, b: u32) -> Error {
    let held = ids[..i].iter().filter(|&&x| x == b).count();
    if held == 0 {
        return Error::Value(format!("block_ids: block {b} is already free (ref_cnt 0): double free"));
    }
    let listed = ids.iter().filter(|&&x| x == b).count();
    Error::Value(format!(
        "block_ids: block {b} is listed {listed} times in this call but holds {held} reference{}",
        if held == 1 { "" } else { "s" }
    ))
}
