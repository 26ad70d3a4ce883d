//! `DigestMemo`: a bounded memo of recently computed block digests, keyed by the exact hash
//! input of a block that has no extra keys: the parent digest and the block's token ids.
//!
//! Serving traffic hashes the same blocks again and again: every request that starts with a
//! shared system prompt hashes that prompt's blocks when it is created (vLLM hashes each
//! prompt in full, per request). The memo remembers recent digests so that such a block
//! costs a lookup instead of a SHA-256 (or XXH3) of its serialization.
//!
//! A hit is exact: an entry matches only if its parent bytes and every token id are equal,
//! so the digest returned is the one the hash function gives for that input; the XXH3 hash
//! of the key only picks the set and screens the ways. The memo is 4-way set-associative,
//! with a fixed number of slots set at construction; a new entry replaces the least recently
//! used one of its set (a direct-mapped memo lost whole prompts: one collision between two
//! blocks of the same prompt cut every later request's memoized run at that block). One memo
//! serves one algorithm and one block size (its owner's); extra keys are not part of the key,
//! so blocks with extra keys must not be memoized.
//!
//! Admission ([`DigestMemo::offer`]): a block is stored the second time it is offered, not
//! the first. Most blocks are never hashed twice (unique prompt suffixes, outputs), and
//! storing one costs several cache misses (its key, the slot, releasing the entry it
//! replaces): with every block stored, a memo of 16384 slots made hashing unique prompts
//! about 90 ns per block slower. A first offer only leaves the key's 32-bit fingerprint in a
//! small table of recent first sightings (a "doorkeeper", as in TinyLFU), in sets of 4 that
//! drop their oldest: two blocks of one prompt whose fingerprints met in a one-way table
//! would evict each other's sighting on every pass and never be kept.

use crate::error::{Error, Result};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Words of an entry before its token ids: the parent's length, then its bytes (zero-padded
/// to 32, little-endian words).
const PARENT_WORDS: usize = 5;

/// Longest parent (bytes) the memo keys: a SHA-256 digest.
pub const MAX_PARENT_LEN: usize = 32;

/// Most memory a memo's keys may take (1 GiB).
pub const MAX_KEY_BYTES: usize = 1 << 30;

/// Ways (slots) per set.
pub const WAYS: usize = 4;

/// A set-associative memo of block digests (see the module docs); `V` is the stored digest
/// (e.g. the bytes object handed to Python).
pub struct DigestMemo<V> {
    block_size: usize,
    /// Slots asked for (0: none). The tables below are allocated by the first offer or
    /// insert, not at construction, so an owner that never hashes a block twice (a fleet's
    /// idle engine) costs no memo memory; if that allocation fails the memo stays off.
    slots: usize,
    /// Words per entry: `PARENT_WORDS + block_size`.
    stride: usize,
    /// Number of sets minus one (a power of two); unused when the memo has no slots.
    set_mask: usize,
    /// Per slot: the key's hash with the low bit set, or 0 for an empty slot.
    tags: Vec<u64>,
    /// Per slot: the tick of its last store or hit (least recently used = smallest).
    used: Vec<u64>,
    /// Entry `i` is `keys[i * stride..(i + 1) * stride]`.
    keys: Vec<u64>,
    values: Vec<Option<V>>,
    /// Fingerprints of keys offered once (0: none), in sets of [`WAYS`] chosen by their
    /// hash, newest first: the doorkeeper.
    seen: Vec<u32>,
    tick: u64,
    hits: u64,
    stores: u64,
}

/// The parent as key words; None if it is longer than [`MAX_PARENT_LEN`].
#[inline]
fn parent_words(parent: &[u8]) -> Option<[u64; PARENT_WORDS]> {
    if parent.len() > MAX_PARENT_LEN {
        return None;
    }
    let mut padded = [0u8; MAX_PARENT_LEN];
    padded[..parent.len()].copy_from_slice(parent);
    let mut w = [parent.len() as u64, 0, 0, 0, 0];
    for (dst, chunk) in w[1..].iter_mut().zip(padded.chunks_exact(8)) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        *dst = u64::from_le_bytes(word);
    }
    Some(w)
}

impl<V> DigestMemo<V> {
    /// A memo with room for `capacity` blocks (rounded up to a power of two, at least
    /// [`WAYS`]; 0 keeps nothing) of `block_size` tokens each. Nothing is allocated until the
    /// first [`DigestMemo::offer`], [`DigestMemo::offer_sighted`] or [`DigestMemo::insert`].
    ///
    /// Errors: `Value` if its keys would take more than [`MAX_KEY_BYTES`].
    pub fn new(capacity: usize, block_size: usize) -> Result<Self> {
        let slots = if capacity == 0 || block_size == 0 {
            0
        } else {
            capacity.checked_next_power_of_two().unwrap_or(usize::MAX).max(WAYS)
        };
        let stride = block_size.saturating_add(PARENT_WORDS);
        slots.checked_mul(stride).filter(|&w| w <= MAX_KEY_BYTES / 8).ok_or_else(|| {
            Error::value(
                "digest_memo_blocks",
                format!("{capacity} slots of {block_size} tokens would take more than {} MiB", MAX_KEY_BYTES >> 20),
            )
        })?;
        Ok(DigestMemo {
            block_size,
            slots,
            stride,
            set_mask: (slots / WAYS).saturating_sub(1),
            tags: Vec::new(),
            used: Vec::new(),
            keys: Vec::new(),
            values: Vec::new(),
            seen: Vec::new(),
            tick: 0,
            hits: 0,
            stores: 0,
        })
    }

    /// Allocate the tables on first use: true when they are there. A failed allocation turns
    /// the memo off for good (it only saves work; every digest is still computed right).
    fn ready(&mut self) -> bool {
        if !self.values.is_empty() {
            return true;
        }
        if self.slots == 0 {
            return false;
        }
        let slots = self.slots;
        let tables = (|| -> Result<_> {
            let mut values = Vec::new();
            values
                .try_reserve_exact(slots)
                .map_err(|_| Error::Memory(format!("cannot allocate a digest memo of {slots} slots")))?;
            values.extend((0..slots).map(|_| None));
            Ok((
                Error::try_vec("the digest memo", slots, 0)?,
                Error::try_vec("the digest memo", slots, 0)?,
                Error::try_vec("the digest memo", slots * self.stride, 0)?,
                values,
                Error::try_vec("the digest memo", 2 * slots, 0)?,
            ))
        })();
        match tables {
            Ok((tags, used, keys, values, seen)) => {
                (self.tags, self.used, self.keys, self.values, self.seen) = (tags, used, keys, values, seen);
                true
            }
            Err(_) => {
                self.slots = 0;
                false
            }
        }
    }

    /// Number of slots (blocks the memo can hold), allocated or not yet.
    pub fn capacity(&self) -> usize {
        self.slots
    }

    /// Bytes its tables take now (0 until the first offer or insert).
    pub fn allocated_bytes(&self) -> usize {
        (self.tags.len() + self.used.len() + self.keys.len()) * 8
            + self.values.len() * std::mem::size_of::<Option<V>>()
            + self.seen.len() * 4
    }

    /// Lookups that found their digest.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Digests stored.
    pub fn stores(&self) -> u64 {
        self.stores
    }

    /// The key's tag (its hash with the low bit set, so never 0) and its set's first slot, or
    /// None if the memo has no slots or cannot key it.
    #[inline]
    fn locate(&self, parent: &[u64; PARENT_WORDS], tokens: &[i64]) -> Option<(u64, usize)> {
        if self.values.is_empty() || tokens.len() != self.block_size {
            return None;
        }
        let words = (parent[1], parent[2], parent[3], parent[4]);
        let parent_bytes = [words.0.to_le_bytes(), words.1.to_le_bytes(), words.2.to_le_bytes(), words.3.to_le_bytes()];
        let seed = xxh3_64_with_seed(parent_bytes.as_flattened(), parent[0]);
        // SAFETY: an i64 slice is plain bytes (no padding), `size_of_val` of them.
        let bytes = unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens)) };
        let h = xxh3_64_with_seed(bytes, seed);
        Some((h | 1, ((h >> 32) as usize & self.set_mask) * WAYS))
    }

    /// True if slot `i` holds exactly `(parent, tokens)`.
    #[inline]
    fn holds(&self, i: usize, tag: u64, parent: &[u64; PARENT_WORDS], tokens: &[i64]) -> bool {
        if self.tags[i] != tag {
            return false;
        }
        let key = &self.keys[i * self.stride..(i + 1) * self.stride];
        key[..PARENT_WORDS] == *parent && key[PARENT_WORDS..].iter().zip(tokens).all(|(&k, &t)| k == t as u64)
    }

    /// The digest memoized for `(parent, tokens)`, if any.
    #[inline]
    pub fn get(&mut self, parent: &[u8], tokens: &[i64]) -> Option<&V> {
        let p = parent_words(parent)?;
        let (tag, first) = self.locate(&p, tokens)?;
        let i = (first..first + WAYS).find(|&i| self.holds(i, tag, &p, tokens))?;
        self.tick += 1;
        self.used[i] = self.tick;
        self.hits += 1;
        self.values[i].as_ref()
    }

    /// Remember `value` as the digest of `(parent, tokens)`, in place of the same key's entry
    /// or else of the least recently used entry of its set. Returns the value replaced, or
    /// `value` itself when the memo cannot keep it (no slots, a parent over 32 bytes, or not
    /// a whole block).
    pub fn insert(&mut self, parent: &[u8], tokens: &[i64], value: V) -> Option<V> {
        if !self.ready() {
            return Some(value);
        }
        let Some(p) = parent_words(parent) else { return Some(value) };
        let Some((tag, first)) = self.locate(&p, tokens) else { return Some(value) };
        self.store(tag, first, &p, tokens, value)
    }

    /// [`DigestMemo::insert`] on the key's second offer; on a first offer only its
    /// fingerprint is noted and `value` is handed back (a key held already but offered as if
    /// new keeps its entry, which holds the same digest).
    pub fn offer(&mut self, parent: &[u8], tokens: &[i64], value: V) -> Option<V> {
        if !self.ready() {
            return Some(value);
        }
        let Some(p) = parent_words(parent) else { return Some(value) };
        let Some((tag, first)) = self.locate(&p, tokens) else { return Some(value) };
        if !self.sighted(tag) {
            return Some(value);
        }
        self.store(tag, first, &p, tokens, value)
    }

    /// [`DigestMemo::offer`] with the doorkeeper keyed by `sighting`: a well-mixed 64-bit
    /// function of the key that the caller already has, such as the first 8 bytes of the
    /// block's digest (equal keys have equal digests). A first offer then hashes nothing; the
    /// key is hashed only when it is stored. A memo must be offered to one way only: the two
    /// note different fingerprints for the same key.
    pub fn offer_sighted(&mut self, sighting: u64, parent: &[u8], tokens: &[i64], value: V) -> Option<V> {
        if tokens.len() != self.block_size || parent.len() > MAX_PARENT_LEN || !self.ready() {
            return Some(value);
        }
        if !self.sighted(sighting) {
            return Some(value);
        }
        self.insert(parent, tokens, value)
    }

    /// Start loading the doorkeeper set that [`DigestMemo::offer_sighted`] with `sighting`
    /// reads (a hint, see [`crate::prefetch`]). A caller offering a run of blocks prefetches
    /// every set first: the sets are random lines of a table larger than the CPU's nearest
    /// caches, and offered one after another their misses followed each other (about 2.5 µs
    /// of a 32-block prompt's 13 at block size 64, with 16384 slots).
    #[inline]
    pub fn prefetch_sighting(&self, sighting: u64) {
        if self.seen.is_empty() {
            return;
        }
        let set = &self.seen[self.seen_group(sighting)..];
        crate::prefetch::prefetch_bytes(set.as_ptr().cast(), WAYS * std::mem::size_of::<u32>());
    }

    /// The first doorkeeper entry of the set of the key whose hash is `h`.
    #[inline(always)]
    fn seen_group(&self, h: u64) -> usize {
        ((h as usize >> 1) & (self.seen.len() / WAYS).saturating_sub(1)) * WAYS
    }

    /// Note a sighting of the key whose hash is `h` in the doorkeeper: false on a first
    /// sighting (its fingerprint is noted, the oldest of its set dropped), true on a second
    /// (the fingerprint is cleared: the key is stored now).
    #[inline]
    fn sighted(&mut self, h: u64) -> bool {
        let group = self.seen_group(h);
        let seen = &mut self.seen[group..group + WAYS];
        let fingerprint = (h >> 32) as u32 | 1;
        match seen.iter().position(|&f| f == fingerprint) {
            None => {
                seen.rotate_right(1); // the oldest sighting goes
                seen[0] = fingerprint;
                false
            }
            Some(i) => {
                seen[i] = 0;
                true
            }
        }
    }

    /// Store the entry in its set: over the same key, else the least recently used slot.
    fn store(&mut self, tag: u64, first: usize, p: &[u64; PARENT_WORDS], tokens: &[i64], value: V) -> Option<V> {
        let i = (first..first + WAYS).find(|&i| self.holds(i, tag, p, tokens)).unwrap_or_else(|| {
            (first + 1..first + WAYS).fold(first, |lru, i| if self.used[i] < self.used[lru] { i } else { lru })
        });
        let key = &mut self.keys[i * self.stride..(i + 1) * self.stride];
        key[..PARENT_WORDS].copy_from_slice(p);
        for (k, &t) in key[PARENT_WORDS..].iter_mut().zip(tokens) {
            *k = t as u64;
        }
        self.tick += 1;
        self.used[i] = self.tick;
        self.tags[i] = tag;
        self.stores += 1;
        self.values[i].replace(value)
    }

    /// Forget every entry (the counters stay) and return the values held.
    pub fn clear(&mut self) -> Vec<V> {
        self.tags.iter_mut().for_each(|t| *t = 0);
        self.seen.iter_mut().for_each(|s| *s = 0);
        self.used.iter_mut().for_each(|u| *u = 0);
        self.values.iter_mut().filter_map(Option::take).collect()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.values.iter().filter(|v| v.is_some()).count()
    }

    /// True if no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
