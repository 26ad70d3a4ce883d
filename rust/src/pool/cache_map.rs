//! vLLM's `BlockHashToBlockMap`: `BlockHashWithGroupId -> block(s)`, duplicates allowed.
//!
//! Several blocks may hold the same key (a request that computed a block without hitting it
//! caches its own copy); lookups return the first one inserted (spec §2). A slab holds each
//! key with the ends of its list of *nodes*, linked through per-node arrays. Node `b` (below
//! the number of blocks) is block `b`'s entry under its primary key; the rare further keys of
//! a block (vLLM's partial-prefix entries, `cached_block_hashes_by_block`) get overflow nodes
//! numbered from the block count up. The lookup table is a [`SlotTable`]: 8 bytes a bucket
//! (a key's 32-bit tag and its slot number; keys are compared in the slab), so a lookup reads
//! one bucket line and one slab entry, and a caller that knows its keys ahead of time can
//! start loading their buckets ([`CacheMap::prefetch_key`], [`CacheMap::prefetch_slot_bucket`])
//! so that the misses of many lookups overlap. Insert, lookup and remove are O(1) however many
//! duplicates a key has.
//!
//! A key can also be *detached*: taken out of the lookup table while its blocks keep it (what
//! vLLM code sees when a key is popped from the map's inner dict without resetting the blocks,
//! and what a block's hash set by hand is before it is inserted). A detached key finds nothing;
//! removing its last node frees it; re-attaching puts it back.

use crate::error::{Error, Result};
use crate::hashing::Digest;
use crate::pool::link::{Link, NO_LINK};
use crate::pool::slot_table::SlotTable;
use hashbrown::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Four secret 64-bit seeds, different in every map (from the standard library's randomly
/// keyed SipHash state).
fn random_seed() -> [u64; 4] {
    let s = std::collections::hash_map::RandomState::new();
    [1u64, 2, 3, 4].map(|i| {
        let mut h = s.build_hasher();
        h.write_u64(0x5eed_0000 + i);
        h.finish()
    })
}

/// The full 128-bit product of `a` and `b`, its halves xor-ed.
#[inline(always)]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let x = a as u128 * b as u128;
    (x as u64) ^ ((x >> 64) as u64)
}

/// Little-endian word `i` (of 4) of a 32-byte buffer.
#[inline(always)]
fn word(b: &[u8; 32], i: usize) -> u64 {
    u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]))
}

/// `BlockHashWithGroupId`: a block hash and its KV-cache group.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Key {
    /// The block hash.
    pub hash: Digest,
    /// The KV-cache group id.
    pub group: u32,
}

impl Key {
    /// vLLM's byte layout: `hash + group.to_bytes(4, "big")`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = self.hash.as_bytes().to_vec();
        v.extend_from_slice(&self.group.to_be_bytes());
        v
    }

    /// Parse vLLM's byte layout (`get_block_hash(key) = key[:-4]`, `get_group_id(key) =
    /// key[-4:]` big-endian).
    pub fn from_bytes(b: &[u8]) -> Result<Key> {
        if b.len() < 5 {
            return Err(Error::value(
                "key",
                format!("a BlockHashWithGroupId has a hash and 4 group bytes, got {} bytes", b.len()),
            ));
        }
        let (h, g) = b.split_at(b.len() - 4);
        let hash = Digest::from_slice(h).ok_or_else(|| {
            Error::value("key", format!("the hash part must be 1 to {} bytes, got {}", Digest::MAX_LEN, h.len()))
        })?;
        Ok(Key { hash, group: u32::from_be_bytes([g[0], g[1], g[2], g[3]]) })
    }
}

/// No node / no slot.
pub const NONE: u32 = NO_LINK;

/// A key's nodes: a doubly linked list through per-node links, in insertion order.
#[derive(Clone, Copy, Debug)]
struct Entry {
    key: Key,
    /// The key's table tag ([`CacheMap::tag_of`]), kept so that removal need not rehash it.
    tag: u32,
    head: u32,
    tail: u32,
    /// Out of the lookup table (see the module doc).
    detached: bool,
    /// The key has held two blocks at once (vLLM's map then keeps the key's blocks in a dict
    /// until the key goes, even when one is left).
    multi: bool,
}

/// The hash -> block map over blocks `0..num_blocks`.
#[derive(Clone)]
pub struct CacheMap {
    /// Slot numbers of the attached keys, under their keys' tags.
    table: SlotTable,
    slots: Vec<Entry>,
    free_slots: Vec<u32>,
    /// Links between the nodes of one key (`NONE` at the ends); nodes `0..num_blocks` are the
    /// blocks' primary nodes, the rest overflow nodes.
    node_links: Vec<Link>,
    /// Block of overflow node `num_blocks + i`, or `NONE` for a vacant one.
    overflow_block: Vec<u32>,
    free_overflow: Vec<u32>,
    /// Detached keys, by key, for re-attaching.
    detached: HashMap<Key, u32>,
    num_blocks: u32,
    seed: [u64; 4],
}

impl CacheMap {
    /// An empty map for block ids below `num_blocks`, its lookup table sized for `keys` keys
    /// now (it grows past them as needed). A caching pool holds a key a block at most: sized
    /// for all of them, a filling cache never stops to re-home its table (the size a full
    /// cache reaches anyway).
    pub fn new(num_blocks: usize, keys: usize) -> Result<Self> {
        Ok(CacheMap {
            table: SlotTable::with_capacity(keys)?,
            slots: Vec::new(),
            free_slots: Vec::new(),
            node_links: Error::try_vec("the hash map", num_blocks, Link::NONE)?,
            overflow_block: Vec::new(),
            free_overflow: Vec::new(),
            detached: HashMap::new(),
            num_blocks: num_blocks as u32,
            seed: random_seed(),
        })
    }

    /// Bytes of per-block state (the primary nodes' links).
    pub fn bytes_per_block() -> usize {
        2 * std::mem::size_of::<u32>()
    }

    /// Table hash of a key's hash bytes and group: every byte counts (keys given through the
    /// id API need not be uniform digests: small integers written big-endian share their
    /// first bytes), mixed 16 bytes at a time with this map's secret random seeds by folded
    /// multiplies, so keys crafted to collide would have to know the seeds.
    /// `padded`: the hash bytes zero-padded to 32, `len` their number.
    #[inline(always)]
    fn mix(seed: &[u64; 4], padded: &[u8; 32], len: usize, group: u32) -> u64 {
        let a = folded_multiply(word(padded, 0) ^ seed[0], word(padded, 1) ^ seed[1]);
        let b = folded_multiply(word(padded, 2) ^ seed[2], word(padded, 3) ^ seed[3] ^ len as u64);
        folded_multiply(a ^ seed[2] ^ ((group as u64) << 32), b ^ seed[1])
    }

    /// A key's table tag: the high half of its table hash (its low bits pick the home
    /// bucket, see [`SlotTable`]).
    #[inline(always)]
    fn tag_from(seed: &[u64; 4], padded: &[u8; 32], len: usize, group: u32) -> u32 {
        (Self::mix(seed, padded, len, group) >> 32) as u32
    }

    #[inline(always)]
    fn tag_of(&self, key: &Key) -> u32 {
        Self::tag_from(&self.seed, key.hash.padded(), key.hash.as_bytes().len(), key.group)
    }

    /// Start loading the table bucket a lookup or insert of `key` reads first (a hint: see
    /// [`crate::prefetch`]), so that the misses of a run of keys overlap. Returns the key's
    /// tag, for [`CacheMap::insert_unless_held`] (which then need not compute it again).
    #[inline(always)]
    pub fn prefetch_key(&self, key: &Key) -> u32 {
        let tag = self.tag_of(key);
        self.table.prefetch(tag);
        tag
    }

    /// [`CacheMap::prefetch_key`] for raw digest bytes.
    #[inline(always)]
    pub fn prefetch_bytes(&self, hash: &[u8], group: u32) {
        if let Some(d) = Digest::from_slice(hash) {
            self.table.prefetch(Self::tag_from(&self.seed, d.padded(), hash.len(), group));
        }
    }

    /// The block a node stands for.
    #[inline(always)]
    pub fn block_of(&self, node: u32) -> u32 {
        Self::node_block(self.num_blocks, &self.overflow_block, node)
    }

    /// [`CacheMap::block_of`] from the fields it reads (for a caller holding other fields
    /// mutably).
    #[inline(always)]
    fn node_block(num_blocks: u32, overflow_block: &[u32], node: u32) -> u32 {
        if node < num_blocks {
            node
        } else {
            overflow_block[(node - num_blocks) as usize]
        }
    }

    /// Number of attached keys (`len(cached_block_hash_to_block)`).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True if no key is attached.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The slot of attached `key`.
    #[inline]
    pub fn find(&self, key: &Key) -> Option<u32> {
        let slots = &self.slots;
        self.table.find(self.tag_of(key), |s| slots[s as usize].key == *key)
    }

    /// The first block cached under `key` (`get_one_block`).
    #[inline]
    pub fn get_one(&self, key: &Key) -> Option<u32> {
        self.find(key).map(|s| self.block_of(self.slots[s as usize].head))
    }

    /// [`CacheMap::get_one`] for raw digest bytes (no key copy).
    #[inline]
    pub fn get_one_bytes(&self, hash: &[u8], group: u32) -> Option<u32> {
        let d = Digest::from_slice(hash)?; // no key has another length
        let tag = Self::tag_from(&self.seed, d.padded(), hash.len(), group);
        let slots = &self.slots;
        self.table
            .find(tag, |s| {
                let k = &slots[s as usize].key;
                k.group == group && k.hash.eq_bytes(hash)
            })
            .map(|s| self.block_of(slots[s as usize].head))
    }

    fn blocks_from(&self, head: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut n = head;
        while n != NONE {
            out.push(self.block_of(n));
            n = self.node_links[n as usize].next;
        }
        out
    }

    /// Every block cached under attached `key`, in insertion order.
    pub fn get_all(&self, key: &Key) -> Vec<u32> {
        match self.find(key) {
            Some(s) => self.blocks_from(self.slots[s as usize].head),
            None => Vec::new(),
        }
    }

    /// Every block of `slot`'s key, in insertion order (attached or not).
    pub fn blocks_of_slot(&self, slot: u32) -> Vec<u32> {
        self.blocks_from(self.slots[slot as usize].head)
    }

    /// True if `block` is cached under attached `key` (`contain`).
    pub fn contains(&self, key: &Key, block: u32) -> bool {
        match self.find(key) {
            Some(s) => {
                let mut n = self.slots[s as usize].head;
                while n != NONE {
                    if self.block_of(n) == block {
                        return true;
                    }
                    n = self.node_links[n as usize].next;
                }
                false
            }
            None => false,
        }
    }

    /// A fresh overflow node for `block` (a further key of a block that has a primary one).
    pub fn new_overflow_node(&mut self, block: u32) -> u32 {
        match self.free_overflow.pop() {
            Some(n) => {
                self.overflow_block[(n - self.num_blocks) as usize] = block;
                n
            }
            None => {
                self.overflow_block.push(block);
                self.node_links.push(Link::NONE);
                self.num_blocks + (self.overflow_block.len() - 1) as u32
            }
        }
    }

    fn release_node(&mut self, node: u32) {
        if node >= self.num_blocks {
            self.overflow_block[(node - self.num_blocks) as usize] = NONE;
            self.free_overflow.push(node);
        }
    }

    fn new_slot(&mut self, entry: Entry) -> u32 {
        match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = entry;
                s
            }
            None => {
                self.slots.push(entry);
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Cache `node` (linked nowhere) under `key`, after any nodes already there; returns the
    /// key's slot. O(1).
    pub fn insert_node(&mut self, key: Key, node: u32) -> u32 {
        self.insert_node_unless_held(key, None, node, None).unwrap_or(NONE)
    }

    /// [`CacheMap::insert_node`], unless block `held` is cached under `key` already (then
    /// nothing changes and None is returned): one probe where `contains` then `insert_node`
    /// would make two. O(1) plus the key's duplicates walked when it has some.
    fn insert_node_unless_held(&mut self, key: Key, tag: Option<u32>, node: u32, held: Option<u32>) -> Option<u32> {
        debug_assert!(self.node_links[node as usize].prev == NONE && self.node_links[node as usize].next == NONE);
        let tag = tag.unwrap_or_else(|| self.tag_of(&key));
        let CacheMap { table, slots, free_slots, node_links, num_blocks, overflow_block, .. } = self;
        // one probe finds the key or the bucket it goes in
        match table.find_or_vacant(tag, |s| slots[s as usize].key == key) {
            Ok(s) => {
                let e = &mut slots[s as usize];
                if let Some(block) = held {
                    let mut n = e.head;
                    while n != NONE {
                        if Self::node_block(*num_blocks, overflow_block, n) == block {
                            return None;
                        }
                        n = node_links[n as usize].next;
                    }
                }
                node_links[e.tail as usize].next = node;
                node_links[node as usize].prev = e.tail;
                e.tail = node;
                e.multi = true;
                Some(s)
            }
            Err(v) => {
                let entry = Entry { key, tag, head: node, tail: node, detached: false, multi: false };
                let slot = match free_slots.pop() {
                    Some(s) => {
                        slots[s as usize] = entry;
                        s
                    }
                    None => {
                        slots.push(entry);
                        (slots.len() - 1) as u32
                    }
                };
                table.fill(v, slot);
                Some(slot)
            }
        }
    }

    /// Cache `block`'s primary node under `key` unless `block` is cached under `key` already
    /// (`contains` then `insert` in one probe); returns the key's slot, or None when nothing
    /// changed. `tag`: the key's tag when the caller has it ([`CacheMap::prefetch_key`]).
    #[inline]
    pub fn insert_unless_held(&mut self, key: Key, tag: Option<u32>, block: u32) -> Option<u32> {
        debug_assert!(tag.is_none_or(|t| t == self.tag_of(&key)));
        self.insert_node_unless_held(key, tag, block, Some(block))
    }

    /// Cache `block`'s primary node under `key`; returns the key's slot.
    #[inline]
    pub fn insert(&mut self, key: Key, block: u32) -> u32 {
        self.insert_node(key, block)
    }

    /// A detached key holding only `node` (a hash set on a block without inserting it).
    pub fn insert_detached(&mut self, key: Key, node: u32) -> u32 {
        let tag = self.tag_of(&key);
        let slot = self.new_slot(Entry { key, tag, head: node, tail: node, detached: true, multi: false });
        self.detached.insert(key, slot);
        slot
    }

    /// The key stored in `slot`.
    #[inline]
    pub fn key_of(&self, slot: u32) -> Key {
        self.slots[slot as usize].key
    }

    /// True if `slot`'s key has held two blocks at once (see `Entry`).
    pub fn is_multi(&self, slot: u32) -> bool {
        self.slots[slot as usize].multi
    }

    /// True if `slot`'s key is detached.
    pub fn is_detached(&self, slot: u32) -> bool {
        self.slots[slot as usize].detached
    }

    /// Start loading the slab entry of `slot` (what [`CacheMap::remove`] reads first) without
    /// waiting for it: the pool calls this for every block of an allocation before it evicts
    /// them one by one, so that their cache misses overlap.
    #[inline(always)]
    pub fn prefetch_slot(&self, slot: u32) {
        if let Some(e) = self.slots.get(slot as usize) {
            crate::prefetch::prefetch(e);
        }
    }

    /// Start loading the table bucket that removing `slot`'s key reads first. It reads the
    /// slot's tag, so call it once the entry is loaded ([`CacheMap::prefetch_slot`] a few
    /// blocks earlier).
    #[inline(always)]
    pub fn prefetch_slot_bucket(&self, slot: u32) {
        if let Some(e) = self.slots.get(slot as usize) {
            if !e.detached {
                self.table.prefetch(e.tag);
            }
        }
    }

    /// Unlink `node` from `slot`'s key; the key goes when its last node does (an overflow
    /// node is released). Returns the key and whether it was attached (vLLM's `pop(key,
    /// block_id)` found the block: a `BlockRemoved`), or `None` if the node is not under that
    /// key. O(1).
    pub fn remove(&mut self, slot: u32, node: u32) -> Option<(Key, bool)> {
        let (p, n) = (self.node_links[node as usize].prev, self.node_links[node as usize].next);
        let e = &mut self.slots[slot as usize];
        if p == NONE && e.head != node {
            return None; // not under this key
        }
        self.node_links[node as usize].prev = NONE;
        self.node_links[node as usize].next = NONE;
        if p != NONE {
            self.node_links[p as usize].next = n;
        } else {
            e.head = n;
        }
        if n != NONE {
            self.node_links[n as usize].prev = p;
        } else {
            e.tail = p;
        }
        let (key, tag, head, detached) = (e.key, e.tag, e.head, e.detached);
        if head == NONE {
            // the key's last node went: drop the key
            if detached {
                if self.detached.get(&key) == Some(&slot) {
                    self.detached.remove(&key);
                }
            } else {
                self.table.remove(tag, |s| s == slot);
            }
            self.free_slots.push(slot);
        }
        self.release_node(node);
        Some((key, !detached))
    }

    /// Take attached `key` out of the lookup table, its blocks keeping it (vLLM code popping
    /// the key from the map's dict). Returns its slot.
    pub fn detach(&mut self, key: &Key) -> Option<u32> {
        let slots = &self.slots;
        let slot = self.table.remove(self.tag_of(key), |s| slots[s as usize].key == *key)?;
        self.slots[slot as usize].detached = true;
        // a key detached twice (detach, re-cache, detach) keeps the later slot findable
        self.detached.insert(*key, slot);
        Some(slot)
    }

    /// Detach every attached key.
    pub fn detach_all(&mut self) {
        let slots: Vec<u32> = self.table.iter().collect();
        self.table.clear();
        for s in slots {
            let e = &mut self.slots[s as usize];
            e.detached = true;
            self.detached.insert(e.key, s);
        }
    }

    /// The detached slot of `key`, if any.
    pub fn detached_slot(&self, key: &Key) -> Option<u32> {
        self.detached.get(key).copied()
    }

    /// Put detached `slot` back in the lookup table. Fails (changing nothing) if its key is
    /// attached meanwhile.
    pub fn reattach(&mut self, slot: u32) -> Result<()> {
        let key = self.slots[slot as usize].key;
        if !self.slots[slot as usize].detached {
            return Ok(());
        }
        if self.find(&key).is_some() {
            return Err(Error::State("cannot restore the key: it was cached again meanwhile".into()));
        }
        if self.detached.get(&key) == Some(&slot) {
            self.detached.remove(&key);
        }
        self.slots[slot as usize].detached = false;
        let tag = self.slots[slot as usize].tag;
        self.table.insert_unique(tag, slot);
        Ok(())
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        self.table.clear();
        self.slots.clear();
        self.free_slots.clear();
        self.detached.clear();
        self.node_links.truncate(self.num_blocks as usize);
        self.node_links.iter_mut().for_each(|x| *x = Link::NONE);
        self.overflow_block.clear();
        self.free_overflow.clear();
    }

    /// Every attached `(key, blocks, multi)` (unordered).
    pub fn entries(&self) -> impl Iterator<Item = (Key, Vec<u32>, bool)> + '_ {
        self.table.iter().map(move |s| {
            let e = &self.slots[s as usize];
            (e.key, self.blocks_from(e.head), e.multi)
        })
    }

    /// Every attached `(key, blocks)` pair (unordered).
    pub fn iter(&self) -> impl Iterator<Item = (Key, Vec<u32>)> + '_ {
        self.table.iter().map(move |s| {
            let e = &self.slots[s as usize];
            (e.key, self.blocks_from(e.head))
        })
    }
}
