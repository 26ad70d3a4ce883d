//! The hash map's lookup table: an open-addressing table of `(tag, slot)` pairs, probed
//! linearly, that a caller can *prefetch*.
//!
//! Each bucket is one `u64`: a key's 32-bit tag (the high half of its table hash) above the
//! slot number of its entry in [`crate::pool::cache_map::CacheMap`]'s slab. The tag picks
//! the home bucket (its low bits) and rules out nearly every foreign slot before the slab is
//! read, so a lookup reads one bucket line and one slab entry. Because the home bucket is a
//! plain function of the tag, a caller that knows a key's tag ahead of time can start loading
//! that line ([`SlotTable::prefetch`]) and overlap the misses of many lookups, which a
//! hashbrown table cannot offer. Deletion shifts the following run back (no tombstones), so
//! probes stay short however many keys come and go. Growth re-homes buckets from their tags
//! alone: the slab is not read.

/// A vacant bucket (no slot is `u32::MAX`: that is `NONE`).
const EMPTY: u64 = u64::MAX;

/// Fewest buckets a table that holds anything has.
const MIN_BUCKETS: usize = 16;

#[inline(always)]
fn pack(tag: u32, slot: u32) -> u64 {
    ((tag as u64) << 32) | slot as u64
}

#[inline(always)]
fn tag_of(b: u64) -> u32 {
    (b >> 32) as u32
}

#[inline(always)]
fn slot_of(b: u64) -> u32 {
    b as u32
}

/// A vacant bucket found for a tag (see [`SlotTable::find_or_vacant`]).
#[must_use]
pub struct Vacant {
    index: usize,
    tag: u32,
}

/// Tagged slot numbers, at most three quarters full.
#[derive(Clone, Default)]
pub struct SlotTable {
    buckets: Vec<u64>,
    /// `buckets.len() - 1` (a power of two minus one), or 0 with no buckets.
    mask: usize,
    len: usize,
}

impl SlotTable {
    /// An empty table (it allocates on the first insert).
    pub fn new() -> Self {
        SlotTable::default()
    }

    /// An empty table with room for `n` slots before it first grows (its buckets allocated
    /// now, at most three quarters of them to be filled). Fails with
    /// [`crate::error::Error::Memory`] when they cannot be allocated.
    pub fn with_capacity(n: usize) -> crate::error::Result<Self> {
        if n == 0 {
            return Ok(SlotTable::new());
        }
        let buckets =
            n.saturating_mul(4).div_ceil(3).checked_next_power_of_two().unwrap_or(usize::MAX).max(MIN_BUCKETS);
        let buckets = crate::error::Error::try_vec("the hash map's lookup table", buckets, EMPTY)?;
        Ok(SlotTable { mask: buckets.len() - 1, buckets, len: 0 })
    }

    /// Number of slots held.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if no slot is held.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline(always)]
    fn home(&self, tag: u32) -> usize {
        tag as usize & self.mask
    }

    /// Start loading the bucket a lookup of `tag` reads first (a hint: see
    /// [`crate::prefetch`]).
    #[inline(always)]
    pub fn prefetch(&self, tag: u32) {
        if let Some(b) = self.buckets.get(self.home(tag)) {
            crate::prefetch::prefetch(b);
        }
    }

    /// Index of the bucket holding a slot under `tag` that `eq` accepts.
    #[inline]
    fn find_index(&self, tag: u32, mut eq: impl FnMut(u32) -> bool) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = self.home(tag);
        loop {
            let b = self.buckets[i];
            if b == EMPTY {
                return None;
            }
            if tag_of(b) == tag && eq(slot_of(b)) {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The slot under `tag` that `eq` accepts (the caller compares the keys).
    #[inline]
    pub fn find(&self, tag: u32, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.find_index(tag, eq).map(|i| slot_of(self.buckets[i]))
    }

    /// Room for one more slot (grows the table, re-homing its buckets, when it is three
    /// quarters full).
    #[inline]
    fn reserve_one(&mut self) {
        if (self.len + 1) * 4 > self.buckets.len() * 3 {
            self.grow();
        }
    }

    #[cold]
    fn grow(&mut self) {
        let n = (self.buckets.len() * 2).max(MIN_BUCKETS);
        let old = std::mem::replace(&mut self.buckets, vec![EMPTY; n]);
        self.mask = n - 1;
        for b in old.into_iter().filter(|&b| b != EMPTY) {
            self.place(b);
        }
    }

    /// Put bucket value `b` in the first vacant bucket from its home (room is reserved).
    #[inline(always)]
    fn place(&mut self, b: u64) {
        let mut i = self.home(tag_of(b));
        while self.buckets[i] != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.buckets[i] = b;
    }

    /// Add `slot` under `tag`; the caller knows no held slot has its key.
    pub fn insert_unique(&mut self, tag: u32, slot: u32) {
        self.reserve_one();
        self.place(pack(tag, slot));
        self.len += 1;
    }

    /// The slot under `tag` that `eq` accepts, or else the vacant bucket where a slot under
    /// `tag` goes ([`SlotTable::fill`] it before any other change to the table): one probe
    /// either way.
    #[inline]
    pub fn find_or_vacant(&mut self, tag: u32, mut eq: impl FnMut(u32) -> bool) -> Result<u32, Vacant> {
        self.reserve_one();
        let mut i = self.home(tag);
        loop {
            let b = self.buckets[i];
            if b == EMPTY {
                return Err(Vacant { index: i, tag });
            }
            if tag_of(b) == tag && eq(slot_of(b)) {
                return Ok(slot_of(b));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Put `slot` in the bucket [`SlotTable::find_or_vacant`] found vacant.
    #[inline]
    pub fn fill(&mut self, v: Vacant, slot: u32) {
        debug_assert_eq!(self.buckets[v.index], EMPTY);
        self.buckets[v.index] = pack(v.tag, slot);
        self.len += 1;
    }

    /// Take out the slot under `tag` that `eq` accepts; returns it.
    pub fn remove(&mut self, tag: u32, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let i = self.find_index(tag, eq)?;
        let s = slot_of(self.buckets[i]);
        self.remove_at(i);
        Some(s)
    }

    /// Empty bucket `hole`, moving back each later bucket of its run that may sit there (one
    /// whose home is not between the hole and where it sits), so that every probe still
    /// reaches its slot without passing a vacant bucket.
    fn remove_at(&mut self, mut hole: usize) {
        let mask = self.mask;
        let mut j = (hole + 1) & mask;
        loop {
            let b = self.buckets[j];
            if b == EMPTY {
                break;
            }
            let from_home = j.wrapping_sub(self.home(tag_of(b))) & mask;
            let from_hole = j.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.buckets[hole] = b;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
    }

    /// Every slot held (in bucket order).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.buckets.iter().filter(|&&b| b != EMPTY).map(|&b| slot_of(b))
    }

    /// Drop every slot (the buckets stay allocated).
    pub fn clear(&mut self) {
        self.buckets.iter_mut().for_each(|b| *b = EMPTY);
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_presized_table_takes_its_capacity_without_growing() {
        for n in [1usize, 12, 13, 1000, 16384] {
            let mut t = SlotTable::with_capacity(n).unwrap();
            let buckets = t.buckets.len();
            assert!(buckets.is_power_of_two() && n * 4 <= buckets * 3, "{n}: {buckets}");
            for s in 0..n as u32 {
                t.insert_unique(s.wrapping_mul(0x9E37_79B9), s);
            }
            assert_eq!((t.len(), t.buckets.len()), (n, buckets), "{n}");
            for s in 0..n as u32 {
                assert_eq!(t.find(s.wrapping_mul(0x9E37_79B9), |x| x == s), Some(s));
            }
        }
        assert_eq!(SlotTable::with_capacity(0).unwrap().buckets.len(), 0);
    }

    /// A small xorshift generator (deterministic).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Random inserts and removes against a std map, with tags drawn from a few values so
    /// that runs collide, wrap around the table's end and are shifted back on removal.
    #[test]
    fn matches_a_reference_map_under_random_inserts_and_removes() {
        for tag_bits in [3u32, 6, 32] {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ tag_bits as u64);
            let mut t = SlotTable::new();
            let mut reference: HashMap<u32, u32> = HashMap::new(); // slot -> tag
            let mut next_slot = 0u32;
            for step in 0..if tag_bits < 32 { 4_000 } else { 20_000 } {
                let r = rng.next();
                let tag = if tag_bits == 32 { (r >> 32) as u32 } else { (r >> 40) as u32 & ((1 << tag_bits) - 1) }
                    | 0xf000_0000;
                if !r.is_multiple_of(3) || reference.is_empty() {
                    match t.find_or_vacant(tag, |_| false) {
                        Err(v) => t.fill(v, next_slot),
                        Ok(s) => panic!("found slot {s} no key of which was asked for"),
                    }
                    reference.insert(next_slot, tag);
                    next_slot += 1;
                } else {
                    let victim = *reference.keys().nth((r as usize / 3) % reference.len()).unwrap();
                    let vt = reference.remove(&victim).unwrap();
                    assert_eq!(t.remove(vt, |s| s == victim), Some(victim));
                    assert_eq!(t.remove(vt, |s| s == victim), None);
                }
                if step % 997 == 0 {
                    assert_eq!(t.len(), reference.len());
                    for (&s, &tg) in &reference {
                        assert_eq!(t.find(tg, |x| x == s), Some(s), "slot {s} lost at step {step}");
                    }
                    let mut held: Vec<u32> = t.iter().collect();
                    held.sort_unstable();
                    let mut want: Vec<u32> = reference.keys().copied().collect();
                    want.sort_unstable();
                    assert_eq!(held, want);
                }
            }
        }
    }

    #[test]
    fn find_or_vacant_finds_an_equal_key_instead_of_a_vacant_bucket() {
        let mut t = SlotTable::new();
        let v = t.find_or_vacant(7, |_| false).expect_err("an empty table has no slot");
        t.fill(v, 1);
        assert_eq!(t.find_or_vacant(7, |s| s == 1).ok(), Some(1));
        let v = t.find_or_vacant(7, |_| false).expect_err("no slot is accepted");
        t.fill(v, 2);
        assert_eq!(t.len(), 2);
        assert_eq!(t.find(7, |s| s == 2), Some(2));
        assert_eq!(t.find(8, |_| true), None);
        t.clear();
        assert!(t.is_empty());
        assert_eq!(t.find(7, |_| true), None);
        t.insert_unique(7, 3);
        assert_eq!(t.find(7, |_| true), Some(3));
    }
}
