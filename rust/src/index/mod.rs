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
    slab: Slab,
    instances: Vec<Option<Instance>>,
    by_name: HashMap<String, u32>,
    free_ids: Vec<u32>,
    pairs: usize,
    scratch: Vec<u64>,
    stats: ApplyStats,
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
        let mut new_stored = 0;
        for ev in &batch.events {
            if let Event::Stored { start, end, medium, .. } = ev {
                new_stored += end - start;
                self.medium_or_add(*medium);
            }
        }
        for t in &mut self.tables {
            t.reserve(new_stored)?;
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
                    let table = &mut self.tables[m];
                    let mut tag = parent_tag(parent);
                    for &h in &batch.hashes[start..end] {
                        let d = table.store(h, tag, id, &mut self.slab);
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
                    let table = &mut self.tables[m];
                    for &h in &batch.hashes[start..end] {
                        dropped += table.remove(h, id, &mut self.slab);
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
            for t in &mut self.tables {
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
        let tables: &[Table] = match medium {
            None => &self.tables,
            Some(m) => match self.medium_id(m) {
                Some(i) => std::slice::from_ref(&self.tables[i]),
                None => return,
            },
        };
        if hashes.is_empty() || tables.is_empty() {
            return;
        }
        let w = self.slab.words();
        if w == 1 {
            self.walk_one_word(hashes, tables, out);
        } else {
            self.walk_words(hashes, tables, w, out);
        }
    }

    #[inline(always)]
    fn word_of(&self, tables: &[Table], key: u64, tag: u32) -> u64 {
        let mut acc = 0u64;
        for t in tables {
            if let Some(set) = t.get(key, tag) {
                if set & holders::MULTI == 0 {
                    acc |= 1 << set;
                } else {
                    acc |= self.slab.slot(set & !holders::MULTI)[0];
                }
            }
        }
        acc
    }

    fn walk_one_word(&self, hashes: &[u64], tables: &[Table], out: &mut [u32]) {
        let mut alive = self.word_of(tables, hashes[0], ROOT_TAG);
        let mut i = 1;
        while alive != 0 && i < hashes.len() {
            let cur = self.word_of(tables, hashes[i], parent_tag(Some(hashes[i - 1])));
            let mut dead = alive & !cur;
            while dead != 0 {
                out[dead.trailing_zeros() as usize] = i as u32;
                dead &= dead - 1;
            }
            alive &= cur;
            i += 1;
        }
        while alive != 0 {
            out[alive.trailing_zeros() as usize] = i as u32;
            alive &= alive - 1;
        }
    }

    fn walk_words(&self, hashes: &[u64], tables: &[Table], w: usize, out: &mut [u32]) {
        let fill = |acc: &mut [u64], key: u64, tag: u32| {
            acc.fill(0);
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
            Some(m) => self.tables[m].blocks_of(id, &self.slab),
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
        self.tables.iter().map(Table::len).sum()
    }

    /// Heap bytes held by the tables, the holder sets and the instance registry (its
    /// records, the names twice, the name map's buckets and the free ids; the name map's
    /// control bytes are counted as one byte a bucket).
    pub fn memory_bytes(&self) -> usize {
        self.tables.iter().map(Table::allocation_size).sum::<usize>()
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
}
