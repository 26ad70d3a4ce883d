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
//! Layout: one [`table::Table`] per medium, 16 bytes per (block, parent) node in an
//! open-addressing table kept 53-80% full; holder sets in one `u32` per node (an instance id inline, or a slot of
//! 64-instance bitsets, [`holders::Slab`]). Instances are `u32` ids with their names.

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
}

/// Media a pipelined walk handles (more fall back to the plain walk).
const MAX_MEDIA: usize = 4;
/// How far ahead of the walk a block's home slot is requested.
const PF: usize = 24;
/// How far ahead of the walk a block's node is read (and its holder bitset requested).
const PS: usize = 12;
/// Probed nodes waiting for the walk (a power of two above `PS`).
const RING: usize = 16;

/// One medium's chain-first blocks: their table, and in front of it a filter of one
/// saturating count per hash bucket (at least 4 buckets a node), a few hundred KB that stays
/// in cache, so that a query whose first block no instance holds (most misses) is answered
/// without touching the table. Exact: a zero count means no node of that bucket.
#[derive(Debug, Default)]
struct Roots {
    table: Table,
    filter: Vec<u8>,
}

impl Roots {
    #[inline(always)]
    fn bucket(&self, key: u64) -> usize {
        (table::mix(key) as usize) & (self.filter.len() - 1)
    }

    /// The holder set of `key` as a chain's first block ([`table::EMPTY`]: none).
    #[inline(always)]
    fn get(&self, key: u64) -> u32 {
        if self.filter.is_empty() || self.filter[self.bucket(key)] == 0 {
            return table::EMPTY;
        }
        self.table.get(key, ROOT_TAG).unwrap_or(table::EMPTY)
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
    }

    fn store(&mut self, key: u64, inst: u32, slab: &mut Slab) -> isize {
        let n = self.table.len();
        let d = self.table.store(key, ROOT_TAG, inst, slab);
        self.count(key, self.table.len() as isize - n as isize);
        d
    }

    fn remove(&mut self, key: u64, inst: u32, slab: &mut Slab) -> usize {
        if self.table.is_empty() {
            return 0;
        }
        let n = self.table.len();
        let d = self.table.remove(key, inst, slab);
        self.count(key, self.table.len() as isize - n as isize);
        d
    }

    /// Room in the filter for the table's nodes (after [`Table::reserve`]).
    fn reserve(&mut self) -> Result<()> {
        let want = (self.table.len() + 16).next_power_of_two() * 4;
        if self.filter.len() < want {
            let mut f = Vec::new();
            f.try_reserve_exact(want * 2).map_err(|_| Error::Memory("cannot grow the prefix index".into()))?;
            f.resize(want * 2, 0);
            self.filter = f;
            self.refilter();
        }
        Ok(())
    }

    /// Recount the filter from the table (after nodes went unseen, or a new size).
    fn refilter(&mut self) {
        self.filter.fill(0);
        if self.filter.is_empty() {
            return;
        }
        let mask = self.filter.len() - 1;
        for n in self.table.iter() {
            let c = &mut self.filter[table::mix(n.key) as usize & mask];
            *c = c.saturating_add(1);
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
    pub fn add_instance(&mut self, name: &str) -> Result<u32> {
        if let Some(id) = self.by_name.get(name) {
            return Ok(*id);
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
        let inst = Instance { name: name.to_owned(), last_seen_ms: 0, pairs: 0 };
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
                self.tables.push(Table::default());
                self.roots.push(Roots::default());
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
        let id = self.add_instance(name)?;
        // reserve first: nothing below can fail
        let (mut new_stored, mut new_roots) = (0, 0);
        for ev in &batch.events {
            if let Event::Stored { start, end, medium, parent, .. } = ev {
                new_stored += end - start;
                new_roots += usize::from(parent.is_none() && end > start);
                self.medium_or_add(*medium);
            }
        }
        for t in &mut self.tables {
            t.reserve(new_stored)?;
        }
        for r in &mut self.roots {
            r.table.reserve(new_roots)?;
            r.reserve()?;
        }
        self.slab.reserve(new_stored)?;
        let mut st = ApplyStats::default();
        for ev in &batch.events {
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
                    for &h in &batch.hashes[start..end] {
                        // stored under one tag: the other table loses it
                        let d = if tag == ROOT_TAG {
                            roots.store(h, id, &mut self.slab) - table.remove(h, id, &mut self.slab) as isize
                        } else {
                            table.store(h, tag, id, &mut self.slab) - roots.remove(h, id, &mut self.slab) as isize
                        };
                        if d > 0 {
                            added += d as usize;
                        } else {
                            dropped += d.unsigned_abs();
                        }
                        tag = parent_tag(Some(h));
                    }
                }
                Event::Removed { start, end, medium, group } => {
                    if group != self.group {
                        st.skipped += 1;
                        continue;
                    }
                    let Some(m) = self.medium_id(medium) else { continue };
                    let (table, roots) = (&mut self.tables[m], &mut self.roots[m]);
                    for &h in &batch.hashes[start..end] {
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
        Ok(st)
    }

    /// Totals over every batch applied.
    pub fn totals(&self) -> ApplyStats {
        self.stats
    }

    /// `name` holds `hashes` on `medium`, chained from `parent` (a `BlockStored`).
    pub fn store(&mut self, name: &str, hashes: &[u64], parent: Option<u64>, medium: Option<&str>) -> Result<usize> {
        let batch = Batch {
            ts: 0.0,
            events: vec![Event::Stored {
                start: 0,
                end: hashes.len(),
                parent,
                block_size: self.block_size.unwrap_or(0),
                medium,
                group: self.group,
            }],
            data_parallel_rank: None,
            hashes: hashes.to_vec(),
        };
        Ok(self.apply_batch(name, &batch, 0)?.stored)
    }

    /// `name` no longer holds `hashes` on `medium` (a `BlockRemoved`).
    pub fn remove(&mut self, name: &str, hashes: &[u64], medium: Option<&str>) -> Result<usize> {
        let batch = Batch {
            ts: 0.0,
            events: vec![Event::Removed { start: 0, end: hashes.len(), medium, group: self.group }],
            data_parallel_rank: None,
            hashes: hashes.to_vec(),
        };
        Ok(self.apply_batch(name, &batch, 0)?.removed)
    }

    // -- lookups -----------------------------------------------------------------------------

    /// The longest cached prefix of the chain `hashes` on each instance, in blocks, written
    /// densely: `out[id]` for every id below [`Self::id_bound`] (0: no hit). `medium` None
    /// counts a block held on any medium; an unknown medium matches nothing.
    pub fn match_dense(&self, hashes: &[u64], medium: Option<Option<&str>>, out: &mut Vec<u32>) {
        out.clear();
        out.resize(self.instances.len(), 0);
        let (tables, roots): (&[Table], &[Roots]) = match medium {
            None => (&self.tables, &self.roots),
            Some(m) => match self.medium_id(m) {
                Some(i) => (std::slice::from_ref(&self.tables[i]), std::slice::from_ref(&self.roots[i])),
                None => return,
            },
        };
        if hashes.is_empty() || tables.is_empty() {
            return;
        }
        let w = self.slab.words();
        if tables.len() > MAX_MEDIA {
            return self.walk_words(hashes, roots, tables, w, out);
        }
        match w {
            1 => self.walk::<1>(hashes, roots, tables, out),
            2 => self.walk::<2>(hashes, roots, tables, out),
            3 | 4 => self.walk::<4>(hashes, roots, tables, out),
            5..=8 => self.walk::<8>(hashes, roots, tables, out),
            9..=16 => self.walk::<16>(hashes, roots, tables, out),
            _ => self.walk_words(hashes, roots, tables, w, out),
        }
    }

    /// The holders of one block (its set words in each table, [`table::EMPTY`] for none) as a
    /// bitset.
    #[inline(always)]
    fn gather<const W: usize>(&self, sets: &[u32], acc: &mut [u64; W]) {
        *acc = [0; W];
        for &s in sets {
            if s == table::EMPTY {
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

    /// The chain walk, its probes pipelined: every key is in the query, so block `j`'s home
    /// slot is requested [`PF`] blocks before the walk reaches it, its node read (and a shared
    /// holder set's bitset requested) [`PS`] blocks before; the walk itself then finds both in
    /// cache. Nothing allocated; stops at the first block no instance still matching holds.
    fn walk<const W: usize>(&self, hashes: &[u64], roots: &[Roots], tables: &[Table], out: &mut [u32]) {
        let n = hashes.len();
        let nt = tables.len();
        let mut ring = [[table::EMPTY; MAX_MEDIA]; RING];
        let probe = |j: usize, ring: &mut [[u32; MAX_MEDIA]; RING]| {
            let tag = parent_tag(Some(hashes[j - 1]));
            let slot = &mut ring[j % RING];
            for (k, t) in tables.iter().enumerate() {
                let s = t.get(hashes[j], tag).unwrap_or(table::EMPTY);
                self.slab.prefetch(s);
                slot[k] = s;
            }
        };
        // the first block alone decides a miss: no prefetch traffic for it
        for (k, r) in roots.iter().enumerate() {
            ring[0][k] = r.get(hashes[0]);
        }
        let mut alive = [0u64; W];
        self.gather(&ring[0][..nt], &mut alive);
        if alive == [0; W] {
            return;
        }
        for &h in &hashes[1..n.min(PF)] {
            for t in tables {
                t.prefetch(h);
            }
        }
        for j in 1..n.min(PS) {
            probe(j, &mut ring);
        }
        let mut cur = [0u64; W];
        let mut i = 1;
        while i < n {
            if let Some(&h) = hashes.get(i + PF - 1) {
                for t in tables {
                    t.prefetch(h);
                }
            }
            if i + PS - 1 < n {
                probe(i + PS - 1, &mut ring);
            }
            self.gather(&ring[i % RING][..nt], &mut cur);
            let mut any = 0;
            for k in 0..W {
                let mut dead = alive[k] & !cur[k];
                while dead != 0 {
                    out[k * 64 + dead.trailing_zeros() as usize] = i as u32;
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

    fn walk_words(&self, hashes: &[u64], roots: &[Roots], tables: &[Table], w: usize, out: &mut [u32]) {
        let fill = |acc: &mut [u64], key: u64, tag: u32| {
            acc.fill(0);
            if tag == ROOT_TAG {
                for r in roots {
                    let set = r.get(key);
                    if set != table::EMPTY {
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
            + self.roots.iter().map(|r| r.filter.capacity()).sum::<usize>()
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

/// `out[id] = v` for every bit `id` set in `words`.
fn mark(words: &[u64], out: &mut [u32], v: u32) {
    for (wi, x) in words.iter().enumerate() {
        let mut x = *x;
        while x != 0 {
            out[wi * 64 + x.trailing_zeros() as usize] = v;
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

    /// The pipelined walk against a plain reference, on chains longer than its look-ahead,
    /// 1 to 4 bitset words, two media, holes, re-stores under other parents and removals.
    #[test]
    fn walk_matches_a_reference() {
        use std::collections::HashMap as Map;
        let mut x = 0x1234_5678u64;
        let mut rnd = |n: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % n
        };
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
                    }
                }
            }
        }
    }
}
