//! vLLM's `BlockPool` over a struct-of-arrays block arena (spec §2–§4).
//!
//! Block 0 is the null block. A block is free iff it is linked into the free queue; free blocks
//! may still carry a hash (they are eviction candidates) and are evicted lazily when
//! allocation pops them. Every fallible operation validates its whole input before it changes
//! anything, so a failed call leaves the pool exactly as it was.

use crate::error::{Error, Result};
use crate::hashing::Digest;
use crate::pool::cache_map::{CacheMap, Key};
use crate::pool::events::Event;
use crate::pool::free_queue::FreeQueue;

/// The null block's id.
pub const NULL_BLOCK: u32 = 0;
const NO_KEY: u32 = u32::MAX;

/// The block pool.
#[derive(Clone)]
pub struct BlockPool {
    num_blocks: usize,
    enable_caching: bool,
    hash_block_size: usize,
    ref_cnt: Vec<u32>,
    /// Slot of the block's key in `map`, or `NO_KEY`.
    key_slot: Vec<u32>,
    queue: FreeQueue,
    map: CacheMap,
    events_enabled: bool,
    events: Vec<Event>,
    scratch: Vec<u32>,
    scratch2: Vec<u32>,
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
            ref_cnt: Error::try_vec("the block arena", num_blocks, 0)?,
            key_slot: Error::try_vec("the block arena", num_blocks, NO_KEY)?,
            queue,
            map: CacheMap::new(num_blocks)?,
            events_enabled: enable_kv_cache_events,
            events: Vec::new(),
            scratch: Vec::new(),
            scratch2: Vec::new(),
        })
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

    /// Bytes of per-block metadata: the arena, the free-queue links and the duplicate-key links
    /// (the hash map's own table and key slab excluded).
    pub fn bytes_per_block() -> usize {
        2 * std::mem::size_of::<u32>() + FreeQueue::bytes_per_block() + CacheMap::bytes_per_block()
    }

    #[inline(always)]
    fn check_id(&self, b: u32) -> Result<()> {
        if (b as usize) < self.num_blocks {
            Ok(())
        } else {
            Err(Error::value("block_id", format!("{b} is out of range [0, {})", self.num_blocks)))
        }
    }

    /// A block's reference count.
    pub fn ref_cnt(&self, b: u32) -> Result<u32> {
        self.check_id(b)?;
        Ok(self.ref_cnt[b as usize])
    }

    /// Check that every id is a block of this pool.
    #[inline]
    pub fn check_ids(&self, ids: &[u32]) -> Result<()> {
        ids.iter().try_for_each(|&b| self.check_id(b))
    }

    /// Number of these (valid) blocks that are free, the null block not counted.
    pub fn count_free(&self, ids: &[u32]) -> usize {
        ids.iter().filter(|&&b| b != NULL_BLOCK && self.ref_cnt[b as usize] == 0).count()
    }

    /// A block's cache key, if it has one.
    pub fn block_key(&self, b: u32) -> Result<Option<Key>> {
        self.check_id(b)?;
        let s = self.key_slot[b as usize];
        Ok((s != NO_KEY).then(|| self.map.key_of(s)))
    }

    /// True if the block is in the free queue.
    pub fn is_free(&self, b: u32) -> bool {
        self.queue.contains(b)
    }

    /// The free queue, head (next to allocate) first.
    pub fn free_queue(&self) -> impl Iterator<Item = u32> + '_ {
        self.queue.iter()
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

    /// `get_cached_block`: one block per group, or `None` if any group misses.
    pub fn get_cached_block(&self, hash: &Digest, groups: &[u32]) -> Option<Vec<u32>> {
        groups.iter().map(|&g| self.lookup(hash, g)).collect()
    }

    fn evict(&mut self, b: u32) -> bool {
        let slot = self.key_slot[b as usize];
        if slot == NO_KEY {
            return false;
        }
        self.key_slot[b as usize] = NO_KEY;
        match self.map.remove(slot, b) {
            Some(key) => {
                if self.events_enabled {
                    self.events.push(Event::BlockRemoved { block_hash: key.hash, group: key.group });
                }
                true
            }
            None => false,
        }
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
                let s = self.key_slot[b as usize];
                if s != NO_KEY {
                    self.map.prefetch_slot(s);
                }
            }
        }
        if let Some(&b) = out[start..].iter().find(|&&b| self.ref_cnt[b as usize] != 0) {
            // a block in use was put in the queue by a raw free-queue call: handing it out
            // would give it two owners; put the popped blocks back where they were
            self.queue.prepend_n(&out[start..]);
            out.truncate(start);
            return Err(Error::State(format!(
                "block {b} is in the free queue but in use (put there by a raw free-queue call)"
            )));
        }
        for &b in &out[start..] {
            if self.enable_caching {
                self.evict(b);
            }
            debug_assert_eq!(self.ref_cnt[b as usize], 0);
            self.ref_cnt[b as usize] = 1;
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
            if b != NULL_BLOCK && self.ref_cnt[b as usize] == 0 && !self.queue.contains(b) {
                return Err(Error::State(format!("block {b} has ref_cnt 0 but is not in the free queue")));
            }
        }
        for &b in ids {
            if b == NULL_BLOCK {
                continue;
            }
            if self.ref_cnt[b as usize] == 0 {
                self.queue.remove(b)?;
            }
            self.ref_cnt[b as usize] += 1;
        }
        Ok(())
    }

    /// Give back the references `free_blocks` took from `ids` before it failed.
    fn undo_decrements(&mut self, ids: &[u32]) {
        for &r in ids {
            if r != NULL_BLOCK {
                self.ref_cnt[r as usize] += 1;
            }
        }
    }

    /// `free_blocks(ordered_blocks)`: drop one reference per listed block (null skipped when
    /// `skip_null`). Blocks reaching 0 are queued: unhashed ones (or all, with caching off)
    /// prepended to the head in the given order, hashed ones appended to the tail in the given
    /// order. Freeing a block whose `ref_cnt` is already 0 fails and changes nothing.
    pub fn free_blocks(&mut self, ids: &[u32], skip_null: bool) -> Result<()> {
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
            let rc = &mut self.ref_cnt[b as usize];
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
        if self.enable_caching && reached.iter().any(|&b| self.key_slot[b as usize] != NO_KEY) {
            let mut unhashed = std::mem::take(&mut self.scratch2);
            unhashed.clear();
            for &b in &reached {
                if self.key_slot[b as usize] != NO_KEY {
                    self.queue.append(b);
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

    /// Cache blocks `table[first..first + hashes.len()]` under `(hashes[i], group)`
    /// (`cache_full_blocks`). Null blocks are skipped (`skip_null`) or rejected. A block that
    /// already has a key loses it first (`BlockRemoved`). With events on, one `BlockStored`
    /// covers the newly cached blocks.
    #[allow(clippy::too_many_arguments)] // vLLM's cache_full_blocks arguments, plus the event tag
    pub fn cache_blocks(
        &mut self,
        table: &[u32],
        first: usize,
        hashes: &[Digest],
        parent: Option<Digest>,
        block_size: usize,
        group: u32,
        skip_null: bool,
        tag: u64,
    ) -> Result<()> {
        let end = first + hashes.len();
        if end > table.len() {
            return Err(Error::value("num_full_blocks", format!("{end} exceeds the {} blocks given", table.len())));
        }
        for &b in &table[first..end] {
            self.check_id(b)?;
            if b == NULL_BLOCK && !skip_null {
                return Err(Error::value("blocks", "cannot cache the null block"));
            }
        }
        let mut stored = Vec::new();
        let mut null_offsets = Vec::new();
        for (i, &b) in table[first..end].iter().enumerate() {
            if b == NULL_BLOCK {
                if self.events_enabled {
                    null_offsets.push(i as u32);
                }
                continue;
            }
            self.evict(b);
            let slot = self.map.insert(Key { hash: hashes[i], group }, b);
            self.key_slot[b as usize] = slot;
            if self.events_enabled {
                stored.push(hashes[i]);
            }
        }
        if self.events_enabled && !stored.is_empty() {
            self.events.push(Event::BlockStored {
                block_hashes: stored,
                parent_block_hash: parent,
                first_block: first,
                num_blocks: end - first,
                null_offsets,
                block_size,
                group,
                tag,
            });
        }
        Ok(())
    }

    /// Record a `BlockStored` for blocks that were already cached (vLLM's
    /// `emit_cached_block_events`, for `kv_cache_report_mode == "full"`); no state change.
    pub fn record_stored(&mut self, hashes: Vec<Digest>, block_size: usize, group: u32, tag: u64) {
        if self.events_enabled && !hashes.is_empty() {
            self.events.push(Event::BlockStored {
                num_blocks: hashes.len(),
                block_hashes: hashes,
                parent_block_hash: None,
                first_block: 0,
                null_offsets: Vec::new(),
                block_size,
                group,
                tag,
            });
        }
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

    /// `evict_blocks(ids)`: drop the cache keys of these blocks (ref counts and queue position
    /// unchanged).
    pub fn evict_blocks(&mut self, ids: &[u32]) -> Result<()> {
        for &b in ids {
            self.check_id(b)?;
        }
        for &b in ids {
            self.evict(b);
        }
        Ok(())
    }

    /// `reset_prefix_cache()`: only when every non-null block is free; clears every key and
    /// records `AllBlocksCleared`. Returns false (changing nothing) otherwise.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_blocks - self.num_free_blocks() != 1 {
            return false;
        }
        self.map.clear();
        self.key_slot.iter_mut().for_each(|s| *s = NO_KEY);
        if self.events_enabled {
            self.events.push(Event::AllBlocksCleared);
        }
        true
    }

    /// `take_events()`: the buffered events, oldest first.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// The buffered events, oldest first.
    pub fn pending_events(&self) -> &[Event] {
        &self.events
    }

    /// Number of buffered events.
    pub fn num_pending_events(&self) -> usize {
        self.events.len()
    }

    /// Check the pool's invariants (for tests): queue membership matches `ref_cnt == 0`, keys
    /// and the map agree.
    pub fn check_invariants(&self) -> Result<()> {
        let mut free = 0;
        for b in 1..self.num_blocks as u32 {
            let in_q = self.queue.contains(b);
            if in_q != (self.ref_cnt[b as usize] == 0) {
                return Err(Error::State(format!("block {b}: in queue {in_q}, ref_cnt {}", self.ref_cnt[b as usize])));
            }
            free += in_q as usize;
            let s = self.key_slot[b as usize];
            if s != NO_KEY && !self.map.contains(&self.map.key_of(s), b) {
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
