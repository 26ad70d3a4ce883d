//! An exact, event-driven prefix index across engine instances (PyO3-free).
//!
//! [`PrefixIndex`] maps vLLM block hashes (the 64-bit ints KV events publish; digests are
//! reduced to the same int, see [`wire::event_int_of_digest`]) to the instances holding them,
//! per medium (`"GPU"`, `"CPU"`, ...), each block with the tag of the parent hash its holder
//! reported. It is fed whole `KVEventBatch` payloads ([`PrefixIndex::apply_payload`]: decoded
//! from the msgpack bytes, then applied; a malformed payload changes nothing) and answers
//! [`PrefixIndex::match_prefix`]: the longest cached prefix of a request's block chain, per
//! instance.
//!
//! Semantics (what "holds" means): instance `i` holds hash `h` under parent `p` from the
//! `BlockStored` that listed `h` (its parent: the event's `parent_block_hash` for the first
//! block, the previous hash for the others) until a `BlockRemoved` of `h`, an
//! `AllBlocksCleared`, a newer `BlockStored` of `h` under another parent, or the instance's
//! removal. A chain `q` matches `i` up to `k` blocks if `i` holds every `q[j]`, `j < k`,
//! under parent `q[j-1]` (no parent for `j = 0`). Holder sets are sets, not counts: when
//! vLLM caches two copies of one block (two requests computed it at once) and evicts one, the
//! index forgets the block; it under-reports then, never over-reports.
//!
//! Events of another KV-cache group than the index's, or (when the index has a block size)
//! of another block size, are skipped and counted.
//!
//! Layout: one [`table::Table`] per medium: a chain arena of 16-byte (block, parent, holder
//! set) nodes in which a chain's blocks lie next to each other (laid out in chain order as it
//! grows), a 4-byte continuation hint per node, and an 8-byte-slot hash index kept 53-80%
//! full; a lookup probes the index where a stored run starts and reads the rest of the run
//! contiguously (its newest nodes settled in chain order every 32Ki). A chain's first block
//! lives in a small roots table whose hint names where the chain's second block went, so a
//! walk starts without a probe of the big index. Holder sets in one `u32` per node (an instance id inline, or a slot of
//! 64-instance bitsets, [`holders::Slab`]). Instances are `u32` ids with their names.

pub mod depth;
pub mod holders;
pub mod table;
pub mod wire;

use crate::error::{Error, Result};
use hashbrown::HashMap;
use holders::{Slab, MAX_INSTANCE};
use table::{parent_tag, Table, ROOT_TAG};
use wire::{Batch, Event};

pub use table::parent_tag as tag_of_parent;

/// What one event batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ApplyStats {
    /// (block, holder) pairs added.
    pub stored: usize,
    /// Pairs removed (by `BlockRemoved`, `AllBlocksCleared` or a re-store under a new parent).
    pub removed: usize,
    /// `AllBlocksCleared` events.
    pub cleared: usize,
    /// Events skipped (another group or block size).
    pub skipped: usize,
}

#[derive(Debug, Clone)]
struct Instance {
    name: String,
    last_seen_ms: u64,
    pairs: usize,
    /// The medium, hash and arena position of the last block this instance stored outside
    /// the roots (a hint: an engine's next `BlockStored` often continues it).
    last: (usize, u64, usize),
}

/// The fleet's prefix index. See the module docs.
#[derive(Debug)]
pub struct PrefixIndex {
    block_size: Option<i64>,
    group: i64,
    media: Vec<Option<String>>,
    tables: Vec<Table>,
    /// Per medium, the chains' first blocks (parent tag [`ROOT_TAG`]) apart from the rest: a
    /// small table that stays in cache, so a lookup that misses at its first block (most
    /// misses) costs no memory access, and every walk starts without one.
    roots: Vec<Roots>,
    slab: Slab,
    instances: Vec<Option<Instance>>,
    by_name: HashMap<String, u32>,
    free_ids: Vec<u32>,
    pairs: usize,
    scratch: Vec<u64>,
    stats: ApplyStats,
    /// The memory cap: most (block, holder) pairs kept (None: no cap).
    max_pairs: Option<usize>,
    evicted: Evicted,
}

/// What the memory cap dropped (totals).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    /// (block, holder) pairs dropped.
    pub pairs: usize,
    /// Nodes (a block under one parent, on one medium, with all its holders) deleted.
    pub nodes: usize,
    /// Times the cap was enforced (batches that went over it, or a lowered cap).
    pub sweeps: usize,
}

/// Media the arena walk handles (more fall back to the plain walk).
const MAX_MEDIA: usize = 4;
/// How far ahead of a `BlockStored`'s store its blocks' home index slots (and roots filter
/// words) are requested, and the nodes those slots name: a batch's first `SLOT_AHEAD`
/// slots are all requested before any is read, so their misses overlap (an engine's batch
/// is a handful of blocks: requesting each only a few blocks ahead left the first reads
/// waiting one after another). A batch that continues a chain the arena already holds
/// requests no index slot until it stops finding its blocks there.
const SLOT_AHEAD: usize = 16;
const NODE_AHEAD: usize = 8;
/// How far ahead along a run the walk requests the node a continuation hint names.
const HINT_AHEAD: usize = 6;
/// How far ahead along a run the walk requests a node's holder bitset.
const SET_AHEAD: usize = 8;

/// One medium's chain-first blocks: their table, and in front of it a filter: one
/// saturating count per hash bucket (4-8 buckets a node) kept for updates, and the bit
/// "count > 0" per bucket that lookups read, one byte per first block (a fleet's 100k
/// chains: 128 KB, which stays in the core's own cache where the counts would not), so a
/// query whose first block no instance holds (most misses) is answered without touching
/// the table. Exact: a clear bit means no node of that bucket.
#[derive(Debug, Default)]
struct Roots {
    table: Table,
    filter: Vec<u8>,
    bits: Vec<u64>,
}

impl Roots {
    #[inline(always)]
    fn bucket(&self, key: u64) -> usize {
        (table::mix(key) as usize) & (self.filter.len() - 1)
    }

    /// The holder set of `key` as a chain's first block ([`holders::EMPTY`]: none).
    #[inline(always)]
    fn get(&self, key: u64) -> u32 {
        self.get_hinted(key).0
    }

    /// Start loading the filter word of `key` (a hint).
    #[inline(always)]
    fn prefetch(&self, key: u64) {
        if !self.bits.is_empty() {
            let b = self.bucket(key);
            if let Some(w) = self.bits.get(b / 64) {
                crate::prefetch::prefetch(w);
            }
        }
    }

    /// Follow a change of `delta` nodes of `key`.
    fn count(&mut self, key: u64, delta: isize) {
        if delta == 0 || self.filter.is_empty() {
            return;
        }
        let b = self.bucket(key);
        let c = &mut self.filter[b];
        // a saturated count stays (it may only over-state: a probe, never a wrong answer)
        if *c != u8::MAX {
            *c = (*c as isize + delta).clamp(0, u8::MAX as isize) as u8;
        }
        let (w, bit) = (b / 64, 1u64 << (b % 64));
        if *c == 0 {
            self.bits[w] &= !bit;
        } else {
            self.bits[w] |= bit;
        }
    }

    /// Also returns the node's position in the roots table.
    fn store(&mut self, key: u64, inst: u32, slab: &mut Slab) -> (isize, usize) {
        let n = self.table.len();
        let (d, at) = self.table.store(key, ROOT_TAG, inst, 1, slab);
        self.count(key, self.table.len() as isize - n as isize);
        (d, at)
    }

    /// [`Self::get`], and the hint of where a chain's second block under `key` went in the
    /// medium's table (a position to check, or past its end).
    #[inline(always)]
    fn get_hinted(&self, key: u64) -> (u32, usize) {
        if self.bits.is_empty() {
            return (holders::EMPTY, usize::MAX - 1);
        }
        let b = self.bucket(key);
        if self.bits[b / 64] >> (b % 64) & 1 == 0 {
            return (holders::EMPTY, usize::MAX - 1);
        }
        match self.table.find(key, ROOT_TAG) {
            Some(p) => (self.table.set_at(p), self.table.hint(p)),
            None => (holders::EMPTY, usize::MAX - 1),
        }
    }

    fn remove(&mut self, key: u64, inst: u32, slab: &mut Slab) -> usize {
        if self.table.is_empty() {
            return 0;
        }
        // every store of a chain's later block, and every removal, asks here: the filter
        // answers most of them without a probe of the table
        let b = self.bucket(key);
        if self.bits[b / 64] >> (b % 64) & 1 == 0 {
            return 0;
        }
        let n = self.table.len();
        let d = self.table.remove(key, inst, slab);
        self.count(key, self.table.len() as isize - n as isize);
        d
    }

    /// [`Table::evict`] on the roots, the filter kept in step.
    fn evict(
        &mut self,
        want: usize,
        shared: bool,
        slab: &mut Slab,
        mut on_drop: impl FnMut(u32, &Slab),
    ) -> table::Swept {
        let Roots { table, filter, bits } = self;
        let mask = filter.len().wrapping_sub(1);
        table.evict(want, shared, slab, |key, set, slab| {
            if !filter.is_empty() {
                let b = table::mix(key) as usize & mask;
                let c = &mut filter[b];
                if *c != u8::MAX {
                    *c -= 1;
                    if *c == 0 {
                        bits[b / 64] &= !(1u64 << (b % 64));
                    }
                }
            }
            on_drop(set, slab);
        })
    }

    /// Room in the filter for the table's nodes (after [`Table::reserve`]).
    fn reserve(&mut self) -> Result<()> {
        let want = (self.table.len() + 16).next_power_of_two() * 4;
        if self.filter.len() < want {
            let mut f = Vec::new();
            f.try_reserve_exact(want * 2).map_err(|_| Error::Memory("cannot grow the prefix index".into()))?;
            f.resize(want * 2, 0);
            let mut bits = Vec::new();
            bits.try_reserve_exact(want * 2 / 64 + 1)
                .map_err(|_| Error::Memory("cannot grow the prefix index".into()))?;
            bits.resize(want * 2 / 64 + 1, 0);
            self.filter = f;
            self.bits = bits;
            self.refilter();
        }
        Ok(())
    }

    /// Recount the filter from the table (after nodes went unseen, or a new size).
    fn refilter(&mut self) {
        self.filter.fill(0);
        self.bits.fill(0);
        if self.filter.is_empty() {
            return;
        }
        let mask = self.filter.len() - 1;
        for n in self.table.iter() {
            let b = table::mix(n.key) as usize & mask;
            self.filter[b] = self.filter[b].saturating_add(1);
            self.bits[b / 64] |= 1 << (b % 64);
        }
    }
}

/// The answer of a lookup: for each instance with a hit, its id and prefix length (blocks).
pub type Matches = Vec<(u32, usize)>;

impl PrefixIndex {
    /// An empty index of KV-cache group `group` (events without `group_idx` are group 0);
    /// `block_size` (tokens), when given, skips events of other block sizes.
    pub fn new(block_size: Option<i64>, group: i64) -> Self {
        PrefixIndex {
            block_size,
            group,
            media: Vec::new(),
            tables: Vec::new(),
            roots: Vec::new(),
            slab: Slab::new(),
            instances: Vec::new(),
            by_name: HashMap::new(),
            free_ids: Vec::new(),
            pairs: 0,
            scratch: Vec::new(),
            stats: ApplyStats::default(),
            max_pairs: None,
            evicted: Evicted::default(),
        }
    }

    pub fn block_size(&self) -> Option<i64> {
        self.block_size
    }

    pub fn group(&self) -> i64 {
        self.group
    }

    // -- instances ---------------------------------------------------------------------------

    /// The id of instance `name`, registering it if new (ids of removed instances are reused).
    /// An empty name is refused (`ValueError` naming `name`), changing nothing.
    pub fn add_instance(&mut self, name: &str) -> Result<u32> {
        if let Some(id) = self.by_name.get(name) {
            return Ok(*id);
        }
        if name.is_empty() {
            return Err(Error::value("name", "an instance name must not be empty"));
        }
        let id = match self.free_ids.pop() {
            Some(id) => id,
            None => {
                let id = self.instances.len();
                if id > MAX_INSTANCE as usize {
                    return Err(Error::value("instance", "too many instances"));
                }
                id as u32
            }
        };
        self.slab.ensure_instance(id)?;
        let inst = Instance { name: name.to_owned(), last_seen_ms: 0, pairs: 0, last: (usize::MAX, 0, 0) };
        if id as usize == self.instances.len() {
            self.instances.push(Some(inst));
        } else {
            self.instances[id as usize] = Some(inst);
        }
        self.by_name.insert(name.to_owned(), id);
        Ok(id)
    }

    /// The id of a registered instance.
    pub fn instance_id(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// The name of instance `id`.
    pub fn instance_name(&self, id: u32) -> Option<&str> {
        self.instances.get(id as usize)?.as_ref().map(|i| i.name.as_str())
    }

    /// Registered instance names, by id.
    pub fn instances(&self) -> Vec<&str> {
        self.instances.iter().flatten().map(|i| i.name.as_str()).collect()
    }

    /// One past the largest instance id in use (the length of [`Self::match_dense`]'s answer).
    pub fn id_bound(&self) -> usize {
        self.instances.len()
    }

    fn known(&self, name: &str) -> Result<u32> {
        self.instance_id(name).ok_or_else(|| Error::NotFound(format!("unknown instance {name:?}")))
    }

    /// Drop every block of `name`, keeping it registered. Returns the pairs removed.
    pub fn clear_instance(&mut self, name: &str) -> Result<usize> {
        let id = self.known(name)?;
        Ok(self.clear_id(id))
    }

    fn clear_id(&mut self, id: u32) -> usize {
        let mut removed = 0;
        for t in &mut self.tables {
            removed += t.clear_instance(id, &mut self.slab);
        }
        for r in &mut self.roots {
            removed += r.table.clear_instance(id, &mut self.slab);
            r.refilter();
        }
        self.sync_hints();
        self.pairs -= removed;
        if let Some(Some(inst)) = self.instances.get_mut(id as usize) {
            inst.pairs = 0;
        }
        removed
    }

    /// Forget instance `name` and its blocks. Returns the pairs removed.
    pub fn remove_instance(&mut self, name: &str) -> Result<usize> {
        let id = self.known(name)?;
        let removed = self.clear_id(id);
        self.instances[id as usize] = None;
        self.by_name.remove(name);
        self.free_ids.push(id);
        Ok(removed)
    }

    /// Record that `name` was heard from at `now_ms` (registering it if new).
    pub fn touch(&mut self, name: &str, now_ms: u64) -> Result<()> {
        let id = self.add_instance(name)?;
        if let Some(Some(inst)) = self.instances.get_mut(id as usize) {
            inst.last_seen_ms = inst.last_seen_ms.max(now_ms);
        }
        Ok(())
    }

    /// Remove the instances last heard from before `now_ms - ttl_ms`; returns their names.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> Vec<String> {
        let cutoff = now_ms.saturating_sub(ttl_ms);
        let dead: Vec<String> =
            self.instances.iter().flatten().filter(|i| i.last_seen_ms < cutoff).map(|i| i.name.clone()).collect();
        for name in &dead {
            // registered: cannot fail
            let _ = self.remove_instance(name);
        }
        dead
    }

    /// (block, holder) pairs of `name` (all media).
    pub fn instance_pairs(&self, name: &str) -> Result<usize> {
        let id = self.known(name)?;
        Ok(self.instances[id as usize].as_ref().map_or(0, |i| i.pairs))
    }

    // -- media -------------------------------------------------------------------------------

    fn medium_id(&self, medium: Option<&str>) -> Option<usize> {
        self.media.iter().position(|m| m.as_deref() == medium)
    }

    fn medium_or_add(&mut self, medium: Option<&str>) -> usize {
        match self.medium_id(medium) {
            Some(m) => m,
            None => {
                self.media.push(medium.map(str::to_owned));
                let mut t = Table::default();
                if self.max_pairs.is_some() {
                    // an empty table: nothing to compute, and no slot array to allocate yet
                    let _ = t.track_depths(Some(Vec::new()), &self.slab);
                }
                // the roots' hints name positions in the table: it says when its nodes move
                t.record_moves = true;
                self.tables.push(t);
                let mut r = Roots::default();
                r.table.foreign_hints = true;
                self.roots.push(r);
                self.media.len() - 1
            }
        }
    }

    /// The media seen so far (None: events without a medium).
    pub fn media(&self) -> &[Option<String>] {
        &self.media
    }

    // -- events ------------------------------------------------------------------------------

    /// Decode the msgpack `KVEventBatch` `payload` and apply it for instance `name` (which is
    /// registered if new and marked seen at `now_ms`). Atomic: a malformed payload is an
    /// `Error::Value` and changes nothing.
    pub fn apply_payload(&mut self, name: &str, payload: &[u8], now_ms: u64) -> Result<ApplyStats> {
        let mut batch = Batch { hashes: std::mem::take(&mut self.scratch), ..Batch::default() };
        let r = wire::decode_batch_into(payload, &mut batch);
        let out = match r {
            Ok(()) => self.apply_batch(name, &batch, now_ms),
            Err(e) => Err(e),
        };
        self.scratch = std::mem::take(&mut batch.hashes);
        out
    }

    /// Apply decoded events for instance `name` (registered if new, marked seen at `now_ms`).
    pub fn apply_batch(&mut self, name: &str, batch: &Batch<'_>, now_ms: u64) -> Result<ApplyStats> {
        self.apply_events(name, &batch.events, &batch.hashes, now_ms)
    }

    /// [`Self::apply_batch`] of a batch's events and hashes.
    fn apply_events(&mut self, name: &str, events: &[Event<'_>], hashes: &[u64], now_ms: u64) -> Result<ApplyStats> {
        let id = self.add_instance(name)?;
        // reserve first: nothing below can fail
        let (mut new_stored, mut new_roots) = (0, 0);
        for ev in events {
            if let Event::Stored { start, end, medium, parent, .. } = ev {
                new_stored += end - start;
                new_roots += usize::from(parent.is_none() && end > start);
                self.medium_or_add(*medium);
            }
        }
        let mut grown = Ok(());
        for t in &mut self.tables {
            grown = grown.and_then(|_| t.reserve(new_stored));
        }
        self.sync_hints();
        grown?;
        for r in &mut self.roots {
            r.table.reserve(new_roots)?;
            r.reserve()?;
        }
        self.slab.reserve(new_stored)?;
        let mut st = ApplyStats::default();
        for ev in events {
            let (mut added, mut dropped) = (0usize, 0usize);
            match *ev {
                Event::Cleared => {
                    st.removed += self.clear_id(id);
                    st.cleared += 1;
                }
                Event::Stored { start, end, parent, block_size, medium, group } => {
                    if group != self.group || self.block_size.is_some_and(|b| b != block_size) {
                        st.skipped += 1;
                        continue;
                    }
                    let Some(m) = self.medium_id(medium) else { continue };
                    let (table, roots) = (&mut self.tables[m], &mut self.roots[m]);
                    let mut tag = parent_tag(parent);
                    // the roots position of the chain's first block, while its second is due
                    let mut root_at = None;
                    // the chain depth of the block before the first (only kept under a cap)
                    let mut depth = match parent {
                        None => 0,
                        Some(_) if !table.tracks_depths() => depth::DEEP,
                        Some(p) => Self::depth_in(roots, table, p),
                    };
                    // the arena position of the block before (to link a run to the one it
                    // continues)
                    let last = self.instances.get(id as usize).and_then(|i| i.as_ref()).map(|i| i.last);
                    let mut prev = match (parent, last) {
                        (Some(p), Some((lm, lk, lp))) if lm == m && lk == p && table.key_at(lp) == Some(p) => Some(lp),
                        (Some(p), _) if tag != ROOT_TAG => table.find_key(p),
                        _ => None,
                    };
                    let run = &hashes[start..end];
                    // a chain the arena holds already (another holder stored it) is followed
                    // from the block before without the index: its index slots are requested
                    // only where that fails
                    let follows = |q: usize| {
                        run.first().is_some_and(|&h0| {
                            table.key_at(q + 1) == Some(h0) || table.key_at(table.hint(q)) == Some(h0)
                        })
                    };
                    let mut probing = !prev.is_some_and(follows);
                    for &ahead in run.iter().take(SLOT_AHEAD) {
                        if probing {
                            table.prefetch(ahead);
                        }
                        roots.prefetch(ahead);
                    }
                    for (j, &h) in run.iter().enumerate() {
                        if let Some(&ahead) = run.get(j + SLOT_AHEAD) {
                            if probing {
                                table.prefetch(ahead);
                            }
                            roots.prefetch(ahead);
                        }
                        if let Some(&ahead) = run.get(j + NODE_AHEAD).filter(|_| probing) {
                            table.prefetch_node(ahead);
                        }
                        depth = depth.saturating_add(1);
                        // stored under one tag: the other table loses it
                        let d = if tag == ROOT_TAG {
                            prev = None;
                            let (d, rp) = roots.store(h, id, &mut self.slab);
                            root_at = Some(rp);
                            d - table.remove(h, id, &mut self.slab) as isize
                        } else {
                            // where the arena holds the chain already (another holder stored
                            // it), its next block is right after this one's or where its hint
                            // says: no index probe
                            let mut found = None;
                            if let Some(q) = prev {
                                for r in [q + 1, table.hint(q)] {
                                    if let Some(d) = table.store_at(r, h, tag, id, depth, &mut self.slab) {
                                        found = Some((d, r));
                                        break;
                                    }
                                }
                            }
                            let (d, at) = match found {
                                Some(x) => x,
                                None => {
                                    if !probing {
                                        probing = true;
                                        for &ahead in run.iter().skip(j + 1).take(SLOT_AHEAD) {
                                            table.prefetch(ahead);
                                        }
                                    }
                                    let (d, at) = table.store(h, tag, id, depth, &mut self.slab);
                                    if let Some(q) = prev {
                                        table.link(q, at);
                                    }
                                    (d, at)
                                }
                            };
                            if let Some(rp) = root_at.take() {
                                roots.table.set_hint(rp, at);
                            }
                            prev = Some(at);
                            d - roots.remove(h, id, &mut self.slab) as isize
                        };
                        if d > 0 {
                            added += d as usize;
                        } else {
                            dropped += d.unsigned_abs();
                        }
                        tag = parent_tag(Some(h));
                    }
                    if let (Some(p), Some(Some(inst))) = (prev, self.instances.get_mut(id as usize)) {
                        inst.last = (m, hashes[end - 1], p);
                    }
                }
                Event::Removed { start, end, medium, group } => {
                    if group != self.group {
                        st.skipped += 1;
                        continue;
                    }
                    let Some(m) = self.medium_id(medium) else { continue };
                    let (table, roots) = (&mut self.tables[m], &mut self.roots[m]);
                    for &h in &hashes[start..end] {
                        dropped += table.remove(h, id, &mut self.slab) + roots.remove(h, id, &mut self.slab);
                    }
                }
            }
            self.pairs = (self.pairs + added).saturating_sub(dropped);
            if let Some(Some(inst)) = self.instances.get_mut(id as usize) {
                inst.pairs = (inst.pairs + added).saturating_sub(dropped);
            }
            st.stored += added;
            st.removed += dropped;
        }
        if let Some(Some(inst)) = self.instances.get_mut(id as usize) {
            inst.last_seen_ms = inst.last_seen_ms.max(now_ms);
        }
        if st.removed > 0 {
            for t in self.tables.iter_mut().chain(self.roots.iter_mut().map(|r| &mut r.table)) {
                t.maybe_shrink();
            }
        }
        self.stats.stored += st.stored;
        self.stats.removed += st.removed;
        self.stats.cleared += st.cleared;
        self.stats.skipped += st.skipped;
        self.enforce_cap();
        self.sync_hints();
        Ok(st)
    }

    /// Carry the roots' hints (into their medium's table) over the moves the tables made.
    fn sync_hints(&mut self) {
        for (t, r) in self.tables.iter_mut().zip(self.roots.iter_mut()) {
            let moves = t.take_moves();
            r.table.remap_hints(&moves);
        }
    }

    // -- the memory cap ----------------------------------------------------------------------

    /// Keep at most `max_pairs` (block, holder) pairs (None: no cap), evicting at once if the
    /// index holds more. See `enforce_cap` for the policy. A cap makes the index
    /// keep each block's chain depth (one byte a table slot, computed for the blocks it
    /// already holds); removing the cap frees them. Fails only for memory (the cap is set
    /// then, and evicts in the fallback order).
    pub fn set_max_pairs(&mut self, max_pairs: Option<usize>) -> Result<()> {
        self.max_pairs = max_pairs;
        let r = self.track_depths(max_pairs.is_some());
        self.enforce_cap();
        r
    }

    /// The chain depth of `parent` (a block's parent hash) in one medium: 1 for a chain's
    /// first block, [`depth::DEEP`] when the index does not hold it.
    fn depth_in(roots: &Roots, table: &Table, parent: u64) -> u8 {
        if roots.get(parent) != holders::EMPTY {
            1
        } else {
            table.depth_of(parent).unwrap_or(depth::DEEP)
        }
    }

    /// Start (or stop) keeping chain depths. Starting computes the depth of every block
    /// held: a breadth-first walk per medium from the chains' first blocks through the
    /// nodes whose parent tag is the tag of a block reached (a block reached twice keeps
    /// the smaller depth; one never reached is an orphan, [`depth::DEEP`]).
    fn track_depths(&mut self, on: bool) -> Result<()> {
        for m in 0..self.tables.len() {
            if !on {
                self.tables[m].track_depths(None, &self.slab)?;
                continue;
            }
            if self.tables[m].tracks_depths() {
                continue;
            }
            let table = &self.tables[m];
            let mut children: HashMap<u32, Vec<usize>> = HashMap::new();
            let mut depths = Vec::new();
            for (i, n) in table.slot_nodes().enumerate() {
                depths.push(0u8);
                if let Some(n) = n {
                    children.entry(n.tag).or_default().push(i);
                }
            }
            let mut frontier: Vec<u32> = self.roots[m].table.iter().map(|n| parent_tag(Some(n.key))).collect();
            let mut d = 1u8;
            let keys: Vec<u64> = table.slot_nodes().map(|n| n.map_or(0, |n| n.key)).collect();
            while !frontier.is_empty() {
                d = d.saturating_add(1);
                let mut next = Vec::new();
                for t in frontier {
                    for &i in children.get(&t).map_or(&[][..], Vec::as_slice) {
                        if depths[i] == 0 {
                            depths[i] = d;
                            next.push(parent_tag(Some(keys[i])));
                        }
                    }
                }
                frontier = next;
            }
            for (x, n) in depths.iter_mut().zip(table.slot_nodes()) {
                if n.is_some() && *x == 0 {
                    *x = depth::DEEP;
                }
            }
            self.tables[m].track_depths(Some(depths), &self.slab)?;
        }
        Ok(())
    }

    pub fn max_pairs(&self) -> Option<usize> {
        self.max_pairs
    }

    /// What the cap dropped so far.
    pub fn evicted(&self) -> Evicted {
        self.evicted
    }

    /// Evict down to the cap. The policy keeps what routing can use: a lookup walks a chain
    /// from its first block and stops at the first block missing, so a block is only worth
    /// keeping if its chain's earlier blocks are kept too. So:
    /// 1. the deepest blocks go first, across media: the cap finds (from the per-depth
    ///    counts) the depth `D` it must cut at, and drops every block deeper than `D`
    ///    and, at depth `D`, blocks from the clock hand on (an arbitrary order, shared out
    ///    among media by their counts at `D`). Each chain keeps its head, the first `D - 1`
    ///    (or `D`) blocks, and a chain's head is what tells the router where the rest is.
    ///    Orphans (a block whose parent the index does not hold: unreachable) and blocks
    ///    over 254 deep count as deepest. Chains' first blocks come after all the others:
    /// 2. first blocks held by one instance, then shared first blocks (clock order).
    ///
    /// When over the cap, it evicts down to 1/64 below it (a low-water mark), so finding the
    /// deepest blocks (a scan of the one-byte depths from the hand) is paid once per many
    /// evicted pairs. A whole node goes at once. The index then under-reports those blocks
    /// until their engines store them again; it never over-reports: nothing is added.
    fn enforce_cap(&mut self) {
        let Some(cap) = self.max_pairs else { return };
        if self.pairs <= cap {
            return;
        }
        let before = self.pairs;
        let low = cap - cap / 64;
        let PrefixIndex { tables, roots, slab, instances, pairs, evicted, .. } = self;
        let mut forget = |set: u32, slab: &Slab| {
            holders::for_each(set, slab, |id| {
                if let Some(Some(inst)) = instances.get_mut(id as usize) {
                    inst.pairs = inst.pairs.saturating_sub(1);
                }
            })
        };
        let mut account = |sw: table::Swept, pairs: &mut usize| {
            *pairs -= sw.pairs;
            evicted.pairs += sw.pairs;
            evicted.nodes += sw.nodes;
        };
        // 1. deepest first: the cut depth from the per-depth pair counts
        let want = *pairs - low;
        let at = |d: u8| tables.iter().map(|t| t.pairs_at_depth(d)).sum::<usize>();
        let (mut cut, mut deeper) = (depth::DEEP, 0usize);
        while cut > 2 && deeper + at(cut) < want {
            deeper += at(cut);
            cut -= 1;
        }
        let at_cut = at(cut);
        let need = want.saturating_sub(deeper);
        for t in tables.iter_mut().filter(|t| t.tracks_depths()) {
            // this medium's share of the blocks at the cut (rounded up)
            let mine = t.pairs_at_depth(cut);
            let mut budget = if at_cut == 0 { 0 } else { (need * mine).div_ceil(at_cut) };
            let sw = t.evict_deep(cut, &mut budget, slab, |_, set, slab| forget(set, slab));
            account(sw, pairs);
        }
        // (a fallback: what a table not tracking depths, after a failed allocation, holds)
        // 2. chains' first blocks, held by one instance, then shared
        const CHUNK: usize = 256;
        for step in 0..4 {
            let (root, shared) = (step >= 2, step % 2 == 1);
            let mut done = vec![false; tables.len()];
            while *pairs > cap && done.iter().any(|d| !d) {
                for m in 0..tables.len() {
                    if done[m] || *pairs <= cap {
                        continue;
                    }
                    let want = (*pairs - low).min(CHUNK);
                    let sw = if root {
                        roots[m].evict(want, shared, slab, &mut forget)
                    } else {
                        tables[m].evict(want, shared, slab, |_, set, slab| forget(set, slab))
                    };
                    account(sw, pairs);
                    done[m] = sw.exhausted;
                }
            }
        }
        if *pairs < before {
            evicted.sweeps += 1;
        }
    }

    /// Totals over every batch applied.
    pub fn totals(&self) -> ApplyStats {
        self.stats
    }

    /// `name` holds `hashes` on `medium`, chained from `parent` (a `BlockStored`).
    pub fn store(&mut self, name: &str, hashes: &[u64], parent: Option<u64>, medium: Option<&str>) -> Result<usize> {
        let ev = Event::Stored {
            start: 0,
            end: hashes.len(),
            parent,
            block_size: self.block_size.unwrap_or(0),
            medium,
            group: self.group,
        };
        Ok(self.apply_events(name, &[ev], hashes, 0)?.stored)
    }

    /// `name` no longer holds `hashes` on `medium` (a `BlockRemoved`).
    pub fn remove(&mut self, name: &str, hashes: &[u64], medium: Option<&str>) -> Result<usize> {
        let ev = Event::Removed { start: 0, end: hashes.len(), medium, group: self.group };
        Ok(self.apply_events(name, &[ev], hashes, 0)?.removed)
    }

    // -- lookups -----------------------------------------------------------------------------

    /// The longest cached prefix of the chain `hashes` on each instance, in blocks, written
    /// densely: `out[id]` for every id below [`Self::id_bound`] (0: no hit). `medium` None
    /// counts a block held on any medium; an unknown medium matches nothing.
    pub fn match_dense(&self, hashes: &[u64], medium: Option<Option<&str>>, out: &mut Vec<u32>) {
        out.clear();
        out.resize(self.instances.len(), 0);
        match medium {
            None => self.walk_media(hashes, |_| true, out.as_mut_slice()),
            Some(m) => {
                if let Some(i) = self.medium_id(m) {
                    self.walk_media(hashes, |x| x == i, out.as_mut_slice())
                }
            }
        }
    }

    /// The longest cached prefix of the chain `hashes` on each instance with a hit, as
    /// `(id, blocks)` pairs in `out` (cleared first; in no particular order): what
    /// [`Self::match_dense`] gives, without writing a slot per instance (no allocation once
    /// `out` has room).
    pub fn match_sparse(&self, hashes: &[u64], medium: Option<Option<&str>>, out: &mut Vec<(u32, u32)>) {
        out.clear();
        let mut sink = Sparse(out);
        match medium {
            None => self.walk_media(hashes, |_| true, &mut sink),
            Some(m) => {
                if let Some(i) = self.medium_id(m) {
                    self.walk_media(hashes, |x| x == i, &mut sink)
                }
            }
        }
    }

    /// The walk over the media `keep` accepts (into `out`, zeroed, `id_bound` long).
    fn walk_media<S: Sink + ?Sized>(&self, hashes: &[u64], keep: impl Fn(usize) -> bool, out: &mut S) {
        let n = (0..self.tables.len()).filter(|&m| keep(m)).count();
        if hashes.is_empty() || n == 0 {
            return;
        }
        let w = self.slab.words();
        if n > MAX_MEDIA || w > 16 {
            let tables: Vec<&Table> = (0..self.tables.len()).filter(|&m| keep(m)).map(|m| &self.tables[m]).collect();
            let roots: Vec<&Roots> = (0..self.roots.len()).filter(|&m| keep(m)).map(|m| &self.roots[m]).collect();
            return self.walk_words(hashes, &roots, &tables, w, out);
        }
        let first = (0..self.tables.len()).find(|&m| keep(m)).unwrap_or(0);
        let mut tables: [&Table; MAX_MEDIA] = [&self.tables[first]; MAX_MEDIA];
        let mut roots: [&Roots; MAX_MEDIA] = [&self.roots[first]; MAX_MEDIA];
        let mut k = 0;
        for m in (0..self.tables.len()).filter(|&m| keep(m)) {
            tables[k] = &self.tables[m];
            roots[k] = &self.roots[m];
            k += 1;
        }
        let (tables, roots) = (&tables[..k], &roots[..k]);
        if k == 1 {
            match w {
                1 => return self.walk_one::<1, S>(hashes, roots[0], tables[0], out),
                2 => return self.walk_one::<2, S>(hashes, roots[0], tables[0], out),
                4 => return self.walk_one::<4, S>(hashes, roots[0], tables[0], out),
                8 => return self.walk_one::<8, S>(hashes, roots[0], tables[0], out),
                _ => {}
            }
        }
        match w {
            1 => self.walk::<1, S>(hashes, roots, tables, out),
            2 => self.walk::<2, S>(hashes, roots, tables, out),
            3 | 4 => self.walk::<4, S>(hashes, roots, tables, out),
            5..=8 => self.walk::<8, S>(hashes, roots, tables, out),
            _ => self.walk::<16, S>(hashes, roots, tables, out),
        }
    }

    /// Tier-weighted cached prefixes: a block on the GPU is worth more to a request than one
    /// on host memory or disk. `weights` gives each medium's weight (a finite number >= 0;
    /// a medium not named weighs 0). With the distinct positive weights `w1 > w2 > ...`,
    /// `L_k` is instance `i`'s prefix over the media weighing at least `w_k`, and its credit
    /// is `w1 * L_1 + w2 * (L_2 - L_1) + ...`: the prefix on the best tier at its weight,
    /// what the next tier extends it by at the next weight, and so on. A block held on two
    /// tiers counts at the better one's weight whenever the better tier's prefix reaches it,
    /// so the credit never exceeds the per-block best weight (it may be lower: an exact
    /// lower bound, as the index's answers are). `out[id]` gets the credit (in blocks),
    /// `depth[id]` the prefix over every positively weighted medium (`L_last`).
    pub fn match_weighted(
        &self,
        hashes: &[u64],
        weights: &[(Option<&str>, f64)],
        out: &mut Vec<f64>,
        depth: &mut Vec<u32>,
    ) -> Result<()> {
        for (m, w) in weights {
            if !w.is_finite() || *w < 0.0 {
                return Err(Error::value(
                    "weights",
                    format!(
                        "the weight of medium {} must be a finite number >= 0, got {w}",
                        m.map_or("None".into(), |x| format!("{x:?}"))
                    ),
                ));
            }
        }
        let n = self.instances.len();
        out.clear();
        out.resize(n, 0.0);
        depth.clear();
        depth.resize(n, 0);
        let w_of: Vec<f64> = self
            .media
            .iter()
            .map(|m| weights.iter().rev().find(|(x, _)| *x == m.as_deref()).map_or(0.0, |(_, w)| *w))
            .collect();
        let mut tiers: Vec<f64> = w_of.iter().copied().filter(|w| *w > 0.0).collect();
        tiers.sort_by(|a, b| b.total_cmp(a));
        tiers.dedup();
        let mut cur = vec![0u32; n];
        for t in tiers {
            cur.fill(0);
            self.walk_media(hashes, |m| w_of[m] >= t, cur.as_mut_slice());
            for ((o, d), c) in out.iter_mut().zip(depth.iter_mut()).zip(&cur) {
                *o += t * c.saturating_sub(*d) as f64;
                *d = *c;
            }
        }
        Ok(())
    }

    /// The holders of one block (its set words in each table, [`holders::EMPTY`] for none) as a
    /// bitset.
    #[inline(always)]
    fn gather<const W: usize>(&self, sets: &[u32], acc: &mut [u64; W]) {
        *acc = [0; W];
        for &s in sets {
            if s == holders::EMPTY {
                continue;
            }
            if s & holders::MULTI == 0 {
                if let Some(a) = acc.get_mut(s as usize / 64) {
                    *a |= 1 << (s % 64);
                }
            } else {
                for (a, b) in acc.iter_mut().zip(self.slab.slot(s & !holders::MULTI)) {
                    *a |= *b;
                }
            }
        }
    }

    /// The chain walk over the tables' arenas: after block `j` was found at arena position
    /// `p` of a table, block `j + 1` is first looked for at `p + 1` (the next node a run
    /// stored, memory the hardware streams in), and the table's index is probed only where
    /// that is not it (a run's start, a divergence, a hole). Exact either way: a table has
    /// one node per (key, parent tag). Nothing allocated; stops at the first block no
    /// instance still matching holds.
    fn walk<const W: usize, S: Sink + ?Sized>(&self, hashes: &[u64], roots: &[&Roots], tables: &[&Table], out: &mut S) {
        const NONE: usize = usize::MAX - 1;
        let n = hashes.len();
        let nt = tables.len();
        let mut sets = [holders::EMPTY; MAX_MEDIA];
        // per table, where the roots say the chain's second block went (checked like a
        // continuation hint, so the walk's first step needs no probe of the index)
        let mut seed = [NONE; MAX_MEDIA];
        for (k, r) in roots.iter().enumerate() {
            (sets[k], seed[k]) = r.get_hinted(hashes[0]);
            tables[k].prefetch_at(seed[k]);
        }
        let mut alive = [0u64; W];
        self.gather(&sets[..nt], &mut alive);
        if alive == [0; W] {
            return;
        }
        let mut pos = [NONE; MAX_MEDIA];
        let mut cur = [0u64; W];
        let mut i = 1;
        while i < n {
            if nt == 1 && pos[0] != NONE && tables[0].set_at(pos[0] + 1) == sets[0] {
                // one medium, inside a stored run: the blocks whose nodes follow in the
                // arena with the same holders change nothing
                let r = tables[0].run_len(pos[0], sets[0], hashes, i, &self.slab);
                pos[0] += r;
                i += r;
                if i >= n {
                    break;
                }
            }
            let h = hashes[i];
            let tag = parent_tag(Some(hashes[i - 1]));
            // whether a table's set word differs from the previous block's (a flag, not a
            // compare of the arrays: that read the words just written, a stall)
            let mut changed = false;
            for (k, t) in tables.iter().enumerate() {
                let p = pos[k] + 1;
                t.prefetch_hint(p.wrapping_add(HINT_AHEAD));
                t.prefetch_set(p.wrapping_add(SET_AHEAD), &self.slab);
                let mut s = t.at(p, h, tag);
                if s != holders::EMPTY {
                    pos[k] = p;
                } else {
                    let q = if pos[k] == NONE { std::mem::replace(&mut seed[k], NONE) } else { t.hint(pos[k]) };
                    s = t.at(q, h, tag);
                    if s != holders::EMPTY {
                        pos[k] = q;
                    } else {
                        match t.find(h, tag) {
                            Some(p) => {
                                s = t.at(p, h, tag);
                                pos[k] = p;
                            }
                            None => pos[k] = NONE,
                        }
                    }
                }
                changed |= s != sets[k];
                sets[k] = s;
            }
            if !changed {
                // the previous block's holders (a shared prefix's blocks share one interned
                // set): every instance still alive holds this block too
                i += 1;
                continue;
            }
            self.gather(&sets[..nt], &mut cur);
            let mut any = 0;
            for k in 0..W {
                let mut dead = alive[k] & !cur[k];
                while dead != 0 {
                    out.put(k * 64 + dead.trailing_zeros() as usize, i as u32);
                    dead &= dead - 1;
                }
                alive[k] &= cur[k];
                any |= alive[k];
            }
            i += 1;
            if any == 0 {
                return;
            }
        }
        mark(&alive, out, i as u32);
    }

    /// [`Self::walk`] over one medium whose holder sets are `W` words long (a fleet's usual
    /// query): no loop over tables, a block's holders read as `W` words at once, and the
    /// instances that stop matching looked for only when some did (a fragmented prefix
    /// changes holder sets nearly every block, mostly in instances no longer matching).
    fn walk_one<const W: usize, S: Sink + ?Sized>(&self, hashes: &[u64], roots: &Roots, t: &Table, out: &mut S) {
        const NONE: usize = usize::MAX - 1;
        let n = hashes.len();
        let (mut set, mut seed) = roots.get_hinted(hashes[0]);
        t.prefetch_at(seed);
        let mut alive = self.slab.bits_of::<W>(set);
        if alive == [0; W] {
            return;
        }
        const LOG: usize = 16;
        let mut log = [(0u32, [0u64; W]); LOG];
        let mut logged = 0;
        let mut pos = NONE;
        let mut i = 1;
        while i < n {
            if pos != NONE && t.set_at(pos + 1) == set {
                // inside a stored run: the blocks whose nodes follow in the arena with the
                // same holders change nothing
                let r = t.run_len(pos, set, hashes, i, &self.slab);
                pos += r;
                i += r;
                if i >= n {
                    break;
                }
            }
            let h = hashes[i];
            let tag = parent_tag(Some(hashes[i - 1]));
            let p = pos.wrapping_add(1);
            t.prefetch_hint(p.wrapping_add(HINT_AHEAD));
            t.prefetch_set(p.wrapping_add(SET_AHEAD), &self.slab);
            let mut s = t.at(p, h, tag);
            if s != holders::EMPTY {
                pos = p;
            } else {
                let q = if pos == NONE { std::mem::replace(&mut seed, NONE) } else { t.hint(pos) };
                s = t.at(q, h, tag);
                if s != holders::EMPTY {
                    pos = q;
                } else {
                    match t.find(h, tag) {
                        Some(p) => {
                            s = t.at(p, h, tag);
                            pos = p;
                        }
                        None => pos = NONE,
                    }
                }
            }
            // no branch on the holders read (an unpredictable branch on a load that missed
            // the cache waits for it, and throws away the work done past it): the instances
            // that stop matching here go to a log, flushed when full and at the end
            if s != set {
                set = s;
                let cur = self.slab.bits_of::<W>(s);
                let mut gone = [0u64; W];
                let (mut any_gone, mut live) = (0, 0);
                for k in 0..W {
                    gone[k] = alive[k] & !cur[k];
                    alive[k] &= cur[k];
                    any_gone |= gone[k];
                    // (tested here, word by word: comparing the array after reads the words
                    // just stored as wider loads, a store-forwarding stall every block)
                    live |= alive[k];
                }
                log[logged] = (i as u32, gone);
                logged += usize::from(any_gone != 0);
                if logged == LOG {
                    flush(&log[..LOG], out);
                    logged = 0;
                }
                if live == 0 {
                    i += 1;
                    break;
                }
            }
            i += 1;
        }
        flush(&log[..logged], out);
        mark(&alive, out, i as u32);

        fn flush<const W: usize, S: Sink + ?Sized>(log: &[(u32, [u64; W])], out: &mut S) {
            for (at, gone) in log {
                mark(gone, out, *at);
            }
        }
    }

    fn walk_words<S: Sink + ?Sized>(&self, hashes: &[u64], roots: &[&Roots], tables: &[&Table], w: usize, out: &mut S) {
        let fill = |acc: &mut [u64], key: u64, tag: u32| {
            acc.fill(0);
            if tag == ROOT_TAG {
                for r in roots {
                    let set = r.get(key);
                    if set != holders::EMPTY {
                        self.slab.or_into(set, acc);
                    }
                }
                return;
            }
            for t in tables {
                if let Some(set) = t.get(key, tag) {
                    self.slab.or_into(set, acc);
                }
            }
        };
        let mut alive = vec![0u64; w];
        let mut cur = vec![0u64; w];
        let mut dead = vec![0u64; w];
        fill(&mut alive, hashes[0], ROOT_TAG);
        let mut i = 1;
        while i < hashes.len() && alive.iter().any(|x| *x != 0) {
            fill(&mut cur, hashes[i], parent_tag(Some(hashes[i - 1])));
            for ((d, a), c) in dead.iter_mut().zip(alive.iter_mut()).zip(&cur) {
                *d = *a & !c;
                *a &= c;
            }
            mark(&dead, out, i as u32);
            i += 1;
        }
        mark(&alive, out, i as u32);
    }

    /// The longest cached prefix of `hashes` per instance with a hit: `(id, blocks)` by id.
    pub fn match_prefix(&self, hashes: &[u64], medium: Option<Option<&str>>) -> Matches {
        let mut dense = Vec::new();
        self.match_dense(hashes, medium, &mut dense);
        dense.iter().enumerate().filter(|(_, n)| **n > 0).map(|(i, n)| (i as u32, *n as usize)).collect()
    }

    /// Every (hash, parent tag) `name` holds on `medium`.
    pub fn blocks_of(&self, name: &str, medium: Option<&str>) -> Result<Vec<(u64, u32)>> {
        let id = self.known(name)?;
        Ok(match self.medium_id(medium) {
            Some(m) => {
                let mut v = self.roots[m].table.blocks_of(id, &self.slab);
                v.extend(self.tables[m].blocks_of(id, &self.slab));
                v
            }
            None => Vec::new(),
        })
    }

    // -- size --------------------------------------------------------------------------------

    /// (block, holder) pairs (a block held on two media by one instance counts twice).
    pub fn num_pairs(&self) -> usize {
        self.pairs
    }

    /// Distinct (medium, block, parent) nodes.
    pub fn num_nodes(&self) -> usize {
        self.tables.iter().chain(self.roots.iter().map(|r| &r.table)).map(Table::len).sum()
    }

    /// Heap bytes held by the tables, the holder sets and the instance registry (its
    /// records, the names twice, the name map's buckets and the free ids; the name map's
    /// control bytes are counted as one byte a bucket).
    pub fn memory_bytes(&self) -> usize {
        self.tables.iter().chain(self.roots.iter().map(|r| &r.table)).map(Table::allocation_size).sum::<usize>()
            + self.roots.iter().map(|r| r.filter.capacity() + r.bits.capacity() * 8).sum::<usize>()
            + self.slab.allocation_size()
            + self.registry_bytes()
    }

    fn registry_bytes(&self) -> usize {
        let names: usize = self.instances.iter().flatten().map(|i| i.name.capacity()).sum::<usize>()
            + self.by_name.keys().map(String::capacity).sum::<usize>();
        self.instances.capacity() * std::mem::size_of::<Option<Instance>>()
            + names
            + self.by_name.capacity() * (std::mem::size_of::<(String, u32)>() + 1)
            + self.free_ids.capacity() * std::mem::size_of::<u32>()
            + self.media.capacity() * std::mem::size_of::<Option<String>>()
    }
}

/// Where a walk writes each instance's prefix when it ends (written once per instance).
trait Sink {
    fn put(&mut self, id: usize, blocks: u32);
}

/// Dense: `out[id]`, zeroed before the walk.
impl Sink for [u32] {
    #[inline(always)]
    fn put(&mut self, id: usize, blocks: u32) {
        if let Some(x) = self.get_mut(id) {
            *x = blocks;
        }
    }
}

/// Sparse: `(id, blocks)` pairs.
struct Sparse<'a>(&'a mut Vec<(u32, u32)>);

impl Sink for Sparse<'_> {
    #[inline(always)]
    fn put(&mut self, id: usize, blocks: u32) {
        self.0.push((id as u32, blocks));
    }
}

/// `out[id] = v` for every bit `id` set in `words`.
fn mark<S: Sink + ?Sized>(words: &[u64], out: &mut S, v: u32) {
    for (wi, x) in words.iter().enumerate() {
        let mut x = *x;
        while x != 0 {
            out.put(wi * 64 + x.trailing_zeros() as usize, v);
            x &= x - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_counts_the_instance_registry() {
        let mut ix = PrefixIndex::new(None, 0);
        let empty = ix.memory_bytes();
        for i in 0..1000 {
            ix.add_instance(&format!("instance-{i}")).unwrap();
        }
        // each instance: its record, its name twice, a bucket of the name map
        assert!(ix.memory_bytes() >= empty + 1000 * (std::mem::size_of::<Option<Instance>>() + 2 * 12));
    }

    #[test]
    fn chains_and_holders() {
        let mut ix = PrefixIndex::new(None, 0);
        ix.store("a", &[1, 2, 3], None, Some("GPU")).unwrap();
        ix.store("b", &[1, 2], None, Some("GPU")).unwrap();
        ix.store("c", &[9], Some(5), Some("GPU")).unwrap();
        let a = ix.instance_id("a").unwrap();
        let b = ix.instance_id("b").unwrap();
        assert_eq!(ix.match_prefix(&[1, 2, 3, 4], None), vec![(a, 3), (b, 2)]);
        // the chain must start at the root: 2 is not a first block
        assert_eq!(ix.match_prefix(&[2, 3], None), vec![]);
        // 9 is held under parent 5 only
        assert_eq!(ix.match_prefix(&[5, 9], None), vec![]);
        assert_eq!(ix.num_pairs(), 6);
        ix.remove("a", &[2], Some("GPU")).unwrap();
        assert_eq!(ix.match_prefix(&[1, 2, 3], None), vec![(a, 1), (b, 2)]);
        assert_eq!(ix.match_prefix(&[1, 2, 3], Some(Some("CPU"))), vec![]);
        assert_eq!(ix.remove_instance("b").unwrap(), 2);
        assert_eq!(ix.num_pairs(), 3);
        assert!(ix.clear_instance("b").is_err());
    }

    #[test]
    fn restore_under_new_parent_moves_the_holder() {
        let mut ix = PrefixIndex::new(None, 0);
        ix.store("a", &[7], Some(1), None).unwrap();
        ix.store("b", &[7], Some(1), None).unwrap();
        ix.store("a", &[7], Some(2), None).unwrap();
        assert_eq!(ix.num_pairs(), 2);
        assert_eq!(ix.num_nodes(), 2);
        let a = ix.instance_id("a").unwrap();
        let b = ix.instance_id("b").unwrap();
        ix.store("r", &[1], None, None).unwrap();
        ix.store("r", &[2], None, None).unwrap();
        ix.store("a", &[1], None, None).unwrap();
        ix.store("a", &[2], None, None).unwrap();
        ix.store("b", &[1], None, None).unwrap();
        let r = ix.instance_id("r").unwrap();
        let m1 = ix.match_prefix(&[1, 7], None);
        assert_eq!(m1, vec![(a, 1), (b, 2), (r, 1)]);
        assert_eq!(ix.match_prefix(&[2, 7], None), vec![(a, 2), (r, 1)]);
    }

    #[test]
    fn many_instances_use_wide_sets() {
        let mut ix = PrefixIndex::new(None, 0);
        for i in 0..150 {
            let n = 1 + (i % 4);
            ix.store(&format!("e{i}"), &[10, 11, 12, 13][..n], None, Some("GPU")).unwrap();
        }
        let m = ix.match_prefix(&[10, 11, 12, 13], None);
        assert_eq!(m.len(), 150);
        for (id, n) in m {
            assert_eq!(n, 1 + (id as usize % 4));
        }
        assert_eq!(ix.num_pairs(), (0..150).map(|i| 1 + i % 4).sum::<usize>());
        for i in 0..150 {
            ix.remove_instance(&format!("e{i}")).unwrap();
        }
        assert_eq!(ix.num_pairs(), 0);
        assert_eq!(ix.num_nodes(), 0);
    }

    #[test]
    fn expire_removes_silent_instances() {
        let mut ix = PrefixIndex::new(None, 0);
        ix.store("a", &[1], None, None).unwrap();
        ix.store("b", &[1], None, None).unwrap();
        ix.touch("a", 1_000).unwrap();
        ix.touch("b", 5_000).unwrap();
        assert_eq!(ix.expire(6_000, 2_000), vec!["a".to_string()]);
        assert_eq!(ix.instances(), vec!["b"]);
    }

    /// A seeded linear congruential generator: `rnd(n)` in `0..n`.
    fn lcg(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % n
        }
    }

    /// The pipelined walk against a plain reference, on chains longer than its look-ahead,
    /// 1 to 4 bitset words, two media, holes, re-stores under other parents and removals.
    /// A prefix shared by many instances, each missing blocks of its own (the fragmented
    /// shape): every instance's answer is its first hole, many more instances stopping at
    /// distinct blocks than the walk's log of them holds at once, at each set width.
    #[test]
    fn fragmented_prefix_reports_every_first_hole() {
        for &ninst in &[40usize, 100, 200, 300, 500] {
            let mut ix = PrefixIndex::new(None, 0);
            let chain: Vec<u64> = (0..700u64).map(|b| b * 104_729 + 3).collect();
            let mut want = Vec::new();
            for inst in 0..ninst {
                let name = format!("i{inst}");
                let id = ix.add_instance(&name).unwrap();
                for part in chain.chunks(8) {
                    let parent =
                        chain.iter().position(|h| *h == part[0]).and_then(|p| p.checked_sub(1)).map(|p| chain[p]);
                    ix.store(&name, part, parent, None).unwrap();
                }
                // two holes: the first decides; a fifth of the instances keep the whole chain
                if inst % 5 != 4 {
                    let first = 1 + (inst * 37) % 600;
                    ix.remove(&name, &[chain[first], chain[first + 1 + inst % 50]], None).unwrap();
                    want.push((id, first));
                } else {
                    want.push((id, chain.len()));
                }
            }
            want.sort_unstable();
            assert_eq!(ix.match_prefix(&chain, None), want, "instances {ninst}");
            let mut sparse = Vec::new();
            ix.match_sparse(&chain, Some(None), &mut sparse);
            sparse.sort_unstable();
            let sparse: Vec<(u32, usize)> = sparse.into_iter().map(|(i, k)| (i, k as usize)).collect();
            assert_eq!(sparse, want, "sparse: instances {ninst}");
            // a shorter query ends every instance still matching at its end
            let short = &chain[..300];
            let cut: Vec<(u32, usize)> = want.iter().map(|&(i, k)| (i, k.min(300))).collect();
            assert_eq!(ix.match_prefix(short, None), cut, "short: instances {ninst}");
        }
    }

    #[test]
    fn walk_matches_a_reference() {
        use std::collections::HashMap as Map;
        let mut rnd = lcg(0x1234_5678u64);
        for &ninst in &[3usize, 70, 150, 250] {
            let mut ix = PrefixIndex::new(None, 0);
            let media = [Some("GPU"), Some("CPU")];
            let fams: Vec<Vec<u64>> =
                (0..12).map(|f| (0..1 + rnd(90)).map(|b| (f << 32) + b * 7919 + 1).collect()).collect();
            // (medium, instance, hash) -> parent tag
            let mut held: Map<(usize, usize, u64), u32> = Map::new();
            for _ in 0..3000 {
                let inst = rnd(ninst as u64) as usize;
                let name = format!("i{inst}");
                let m = rnd(2) as usize;
                let fam = &fams[rnd(fams.len() as u64) as usize];
                let a = if rnd(3) == 0 { rnd(fam.len() as u64) as usize } else { 0 };
                let b = (a + 1 + rnd(fam.len() as u64) as usize).min(fam.len());
                match rnd(10) {
                    0..=6 => {
                        // a store under the chain's parent, or now and then a wrong one or none (a root)
                        let parent = match (a, rnd(8)) {
                            (0, _) | (_, 1) => None,
                            (_, 0) => Some(99),
                            _ => Some(fam[a - 1]),
                        };
                        ix.store(&name, &fam[a..b], parent, media[m]).unwrap();
                        let mut tag = parent_tag(parent);
                        for &h in &fam[a..b] {
                            held.insert((m, inst, h), tag);
                            tag = parent_tag(Some(h));
                        }
                    }
                    _ => {
                        ix.remove(&name, &fam[a..b], media[m]).unwrap();
                        for h in &fam[a..b] {
                            held.remove(&(m, inst, *h));
                        }
                    }
                }
            }
            for (qi, fam) in fams.iter().enumerate() {
                for q in [&fam[..], &fam[..fam.len() / 2 + 1], &fam[1..]] {
                    for (mi, filter) in [(None, None), (Some(0), Some(media[0])), (Some(1), Some(media[1]))] {
                        let mut want = Vec::new();
                        for inst in 0..ninst {
                            let mut k = 0;
                            while k < q.len() {
                                let tag = if k == 0 { ROOT_TAG } else { parent_tag(Some(q[k - 1])) };
                                let ok = (0..2)
                                    .filter(|m| mi.is_none_or(|x| x == *m))
                                    .any(|m| held.get(&(m, inst, q[k])) == Some(&tag));
                                if !ok {
                                    break;
                                }
                                k += 1;
                            }
                            if k > 0 {
                                let id = ix.instance_id(&format!("i{inst}")).unwrap();
                                want.push((id, k));
                            }
                        }
                        want.sort_unstable();
                        let got = ix.match_prefix(q, filter);
                        assert_eq!(got, want, "instances {ninst}, family {qi}, medium {mi:?}");
                        let mut sparse = Vec::new();
                        ix.match_sparse(q, filter, &mut sparse);
                        sparse.sort_unstable();
                        let sparse: Vec<(u32, usize)> = sparse.into_iter().map(|(i, k)| (i, k as usize)).collect();
                        assert_eq!(sparse, want, "sparse: instances {ninst}, family {qi}, medium {mi:?}");
                    }
                }
            }
        }
    }

    /// Chains shared by 1-4 instances, stored in batches of 8 whose streams interleave (as
    /// a fleet's engines publish), with re-published batches, holes, restores under a wrong
    /// parent and cleared instances: the answers match a reference model at every checkpoint,
    /// while the tables settle their young nodes in chain order many times over and grow.
    #[test]
    fn interleaved_batches_match_a_reference_through_settles() {
        use std::collections::HashMap as Map;
        let mut rnd = lcg(0x9e37_79b9u64);
        let ninst = 24u64;
        let chains: Vec<Vec<u64>> =
            (0..120u64).map(|c| (0..8 + rnd(200)).map(|b| ((c + 1) << 32) + b * 7919 + 1).collect()).collect();
        // per (chain, holder) a script of (parent, batch)
        type Script = Vec<(Option<u64>, Vec<u64>)>;
        let mut scripts: Vec<(u64, Script)> = Vec::new();
        for ch in &chains {
            let h0 = rnd(ninst);
            for k in 0..1 + rnd(4) {
                let mut parent = None;
                let mut script = Vec::new();
                for b in ch.chunks(8) {
                    script.push((parent, b.to_vec()));
                    parent = b.last().copied();
                }
                scripts.push(((h0 + 5 * k) % ninst, script));
            }
        }
        let mut ix = PrefixIndex::new(None, 0);
        let mut held: Map<(u64, u64), u32> = Map::new();
        let mut cursor = vec![0usize; scripts.len()];
        let mut live: Vec<usize> = (0..scripts.len()).collect();
        let mut step = 0;
        let check = |ix: &PrefixIndex, held: &Map<(u64, u64), u32>| {
            for ch in &chains {
                for q in [&ch[..], &ch[..ch.len() / 2 + 1]] {
                    let mut want = Vec::new();
                    for inst in 0..ninst {
                        let mut k = 0;
                        while k < q.len() {
                            let tag = if k == 0 { ROOT_TAG } else { parent_tag(Some(q[k - 1])) };
                            if held.get(&(inst, q[k])) != Some(&tag) {
                                break;
                            }
                            k += 1;
                        }
                        if k > 0 {
                            want.push((ix.instance_id(&format!("i{inst}")).unwrap(), k));
                        }
                    }
                    want.sort_unstable();
                    assert_eq!(ix.match_prefix(q, None), want);
                    let mut sparse = Vec::new();
                    ix.match_sparse(q, None, &mut sparse);
                    sparse.sort_unstable();
                    assert!(sparse.iter().map(|&(i, k)| (i, k as usize)).eq(want.iter().copied()));
                }
            }
        };
        while !live.is_empty() {
            let li = rnd(live.len() as u64) as usize;
            let si = live[li];
            let (inst, script) = &scripts[si];
            let name = format!("i{inst}");
            let (parent, batch) = &script[cursor[si]];
            let parent = if rnd(100) == 0 { Some(99) } else { *parent };
            ix.store(&name, batch, parent, None).unwrap();
            let mut tag = parent_tag(parent);
            for &h in batch {
                held.insert((*inst, h), tag);
                tag = parent_tag(Some(h));
            }
            match rnd(100) {
                0..=2 => {
                    let h = batch[rnd(batch.len() as u64) as usize];
                    ix.remove(&name, &[h], None).unwrap();
                    held.remove(&(*inst, h));
                }
                3 if rnd(20) == 0 => {
                    ix.clear_instance(&name).unwrap();
                    held.retain(|k, _| k.0 != *inst);
                }
                4..=8 => cursor[si] = cursor[si].saturating_sub(1),
                _ => {}
            }
            cursor[si] += 1;
            if cursor[si] == script.len() {
                live.swap_remove(li);
            }
            step += 1;
            if step % 400 == 0 {
                check(&ix, &held);
            }
        }
        check(&ix, &held);
        assert!(ix.num_pairs() > 10_000);
    }

    #[test]
    fn tier_weights_credit_the_best_tier_first() {
        let mut ix = PrefixIndex::new(None, 0);
        let q: Vec<u64> = (1..=8).collect();
        ix.store("a", &q[..4], None, Some("GPU")).unwrap();
        ix.store("a", &q[4..], Some(4), Some("CPU")).unwrap();
        ix.store("b", &q, None, Some("CPU")).unwrap();
        ix.store("c", &q[..2], None, Some("GPU")).unwrap();
        ix.store("c", &q, None, Some("disk")).unwrap();
        let w = [(Some("GPU"), 1.0), (Some("CPU"), 0.75), (Some("disk"), 0.25)];
        let (mut out, mut depth) = (Vec::new(), Vec::new());
        ix.match_weighted(&q, &w, &mut out, &mut depth).unwrap();
        let id = |n: &str| ix.instance_id(n).unwrap() as usize;
        assert_eq!((out[id("a")], depth[id("a")]), (4.0 + 0.75 * 4.0, 8));
        assert_eq!((out[id("b")], depth[id("b")]), (0.75 * 8.0, 8));
        assert_eq!((out[id("c")], depth[id("c")]), (2.0 + 0.25 * 6.0, 8));
        // a medium weighing 0 (or not named) is not counted at all
        ix.match_weighted(&q, &[(Some("GPU"), 1.0)], &mut out, &mut depth).unwrap();
        assert_eq!((out[id("a")], depth[id("a")], out[id("b")], depth[id("c")]), (4.0, 4, 0.0, 2));
        // equal weights are one tier: the prefix over both media
        ix.match_weighted(&q, &[(Some("GPU"), 1.0), (Some("CPU"), 1.0)], &mut out, &mut depth).unwrap();
        assert_eq!(out[id("a")], 8.0);
        for bad in [f64::NAN, -1.0, f64::INFINITY] {
            assert!(ix.match_weighted(&q, &[(Some("GPU"), bad)], &mut out, &mut depth).is_err());
        }
    }

    #[test]
    fn cap_drops_private_tails_before_shared_prefixes() {
        let mut ix = PrefixIndex::new(None, 0);
        let shared: Vec<u64> = (1..=10).collect();
        for (n, base) in [("a", 100u64), ("b", 200)] {
            ix.store(n, &shared, None, Some("GPU")).unwrap();
            let tail: Vec<u64> = (base..base + 10).collect();
            ix.store(n, &tail, Some(10), Some("GPU")).unwrap();
        }
        assert_eq!(ix.num_pairs(), 40);
        ix.set_max_pairs(Some(25)).unwrap();
        assert_eq!(ix.num_pairs(), 25);
        let ev = ix.evicted();
        assert_eq!((ev.pairs, ev.nodes, ev.sweeps), (15, 15, 1));
        let (a, b) = (ix.instance_id("a").unwrap(), ix.instance_id("b").unwrap());
        assert_eq!(ix.match_prefix(&shared, None), vec![(a, 10), (b, 10)]);
        assert_eq!(ix.instance_pairs("a").unwrap() + ix.instance_pairs("b").unwrap(), 25);
        // the cap holds as more arrives; the deepest blocks go first, whoever holds them:
        // the tails' last 5 pairs, then the shared prefix's 10th block, not c's chain
        let c_chain = [500, 501, 502, 503, 504, 505];
        ix.store("c", &c_chain, None, Some("GPU")).unwrap();
        assert_eq!(ix.num_pairs(), 24);
        assert_eq!(ix.match_prefix(&shared, None), vec![(a, 9), (b, 9)]);
        let c = ix.instance_id("c").unwrap();
        assert_eq!(ix.match_prefix(&c_chain, None), vec![(c, 6)]);
        // a whole node goes at once: a shared one may take the index a pair below the cap
        ix.set_max_pairs(Some(4)).unwrap();
        assert!((3..=4).contains(&ix.num_pairs()));
        ix.set_max_pairs(Some(0)).unwrap();
        assert_eq!((ix.num_pairs(), ix.num_nodes()), (0, 0));
        assert_eq!(ix.evicted().pairs, 40 + 6);
    }

    /// Chains of many lengths, some sharing a prefix, on several instances and two media:
    /// a cap keeps every chain's head. With `D` the deepest block kept, every chain still
    /// answers `min(its length, D - 1)` blocks at least (and never more than it holds), both
    /// when the cap is set on a full index (depths computed then) and when it holds as the
    /// chains arrive (depths kept on the way).
    #[test]
    fn cap_keeps_every_chains_head() {
        let mut x = 0x51ed_2701u64;
        let mut rnd = |n: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % n
        };
        let prefix: Vec<u64> = (1..=8).map(|b| (99 << 32) + b).collect();
        let mut chains: Vec<(String, Option<&str>, Vec<u64>)> = Vec::new();
        for c in 0..60u64 {
            let mut ch = if c % 3 == 0 { prefix.clone() } else { Vec::new() };
            ch.extend((0..1 + rnd(40)).map(|b| (c << 32) + b + 1));
            let medium = if c % 4 == 0 { Some("CPU") } else { Some("GPU") };
            chains.push((format!("i{}", rnd(5)), medium, ch));
        }
        let total: usize = chains.iter().map(|c| c.2.len()).sum();
        for cap in [total / 2, total / 5, 60] {
            for upfront in [false, true] {
                let mut ix = PrefixIndex::new(None, 0);
                if !upfront {
                    ix.set_max_pairs(Some(cap)).unwrap();
                }
                for (name, medium, ch) in &chains {
                    // in pieces, each under its parent, as an engine's steps store them
                    let cut = ch.len() / 2;
                    ix.store(name, &ch[..cut.max(1)], None, *medium).unwrap();
                    if cut.max(1) < ch.len() {
                        ix.store(name, &ch[cut.max(1)..], Some(ch[cut.max(1) - 1]), *medium).unwrap();
                    }
                }
                if upfront {
                    ix.set_max_pairs(Some(cap)).unwrap();
                }
                assert!(ix.num_pairs() <= cap && ix.evicted().pairs > 0);
                let deepest = chains
                    .iter()
                    .map(|(_, m, ch)| ix.match_prefix(ch, Some(*m)).first().map_or(0, |x| x.1))
                    .max()
                    .unwrap();
                for (name, m, ch) in &chains {
                    let id = ix.instance_id(name).unwrap();
                    let got = ix.match_prefix(ch, Some(*m)).iter().find(|x| x.0 == id).map_or(0, |x| x.1);
                    assert!(got <= ch.len());
                    assert!(
                        got >= ch.len().min(deepest - 1),
                        "cap {cap}, upfront {upfront}: {got} of {} blocks kept, deepest {deepest}",
                        ch.len()
                    );
                }
            }
        }
    }

    /// Under a cap, random stores and removals over several instances and two media: every
    /// pair the index keeps is one its instance holds (no over-report), the pairs stay under
    /// the cap, and what is missing is exactly what the eviction counter counted and the
    /// events did not remove since.
    #[test]
    fn cap_is_exact_and_counted() {
        use std::collections::HashMap as Map;
        let mut rnd = lcg(0x9e37_79b9u64);
        let media = [Some("GPU"), Some("CPU")];
        for cap in [0usize, 7, 60, 400] {
            let mut ix = PrefixIndex::new(None, 0);
            ix.set_max_pairs(Some(cap)).unwrap();
            let fams: Vec<Vec<u64>> =
                (0..8).map(|f| (0..1 + rnd(40)).map(|b| (f << 32) + b * 31 + 1).collect()).collect();
            // the truth: (medium, instance, hash) -> parent tag
            let mut held: Map<(usize, u64, u64), u32> = Map::new();
            for _ in 0..1500 {
                let inst = rnd(5);
                let name = format!("i{inst}");
                let m = rnd(2) as usize;
                let fam = &fams[rnd(fams.len() as u64) as usize];
                let b = 1 + rnd(fam.len() as u64) as usize;
                let truth_before = held.len();
                let (mut gained, mut lost) = (0usize, 0usize);
                if rnd(4) > 0 {
                    ix.store(&name, &fam[..b], None, media[m]).unwrap();
                    let mut tag = ROOT_TAG;
                    for &h in &fam[..b] {
                        gained += usize::from(held.insert((m, inst, h), tag).is_none());
                        tag = parent_tag(Some(h));
                    }
                } else {
                    ix.remove(&name, &fam[..b], media[m]).unwrap();
                    for h in &fam[..b] {
                        lost += usize::from(held.remove(&(m, inst, *h)).is_some());
                    }
                }
                assert_eq!(held.len(), truth_before + gained - lost);
                assert!(ix.num_pairs() <= cap, "cap {cap}: {} pairs", ix.num_pairs());
                // every pair held but missing from the index was evicted (and counted)
                assert!(held.len() >= ix.num_pairs());
                assert!(held.len() - ix.num_pairs() <= ix.evicted().pairs);
                // no over-report: every pair kept is held, under the parent the truth has
                let mut kept = 0;
                for (mi, med) in media.iter().enumerate() {
                    for i in 0..5u64 {
                        let n = format!("i{i}");
                        if ix.instance_id(&n).is_none() {
                            continue;
                        }
                        let blocks = ix.blocks_of(&n, *med).unwrap();
                        for (h, tag) in &blocks {
                            assert_eq!(held.get(&(mi, i, *h)), Some(tag), "cap {cap}: i{i} over-reports {h}");
                        }
                        kept += blocks.len();
                    }
                }
                assert_eq!(kept, ix.num_pairs());
                let per: usize = (0..5).filter_map(|i| ix.instance_pairs(&format!("i{i}")).ok()).sum();
                assert_eq!(per, ix.num_pairs());
                // and lookups never claim more than the truth's prefix
                for fam in &fams {
                    for (id, k) in ix.match_prefix(fam, None) {
                        let inst: u64 = ix.instance_name(id).unwrap()[1..].parse().unwrap();
                        let mut tag = ROOT_TAG;
                        for &h in &fam[..k] {
                            assert!((0..2).any(|m| held.get(&(m, inst, h)) == Some(&tag)));
                            tag = parent_tag(Some(h));
                        }
                    }
                }
            }
            if cap < 60 {
                assert!(ix.evicted().pairs > 0, "cap {cap}: the workload overflows it");
            }
        }
    }
}
