//! One medium's blocks: 64-bit block hash -> (parent tag, holder set), 16 bytes a block.
//!
//! Each [`Node`] carries a 32-bit tag of the parent hash its holders reported, so a lookup
//! that walks a request's chain only follows a block whose parent is the chain's previous
//! block. An instance holds a hash under one parent (its latest `BlockStored`); a hash stored
//! by different instances under different parents (a 64-bit collision, or bad input) gets
//! one node per parent tag.
//!
//! The table is open addressing with linear probing over a flat array of nodes (no control
//! bytes: an empty slot has the set word [`EMPTY`]), any capacity (the home slot is a
//! multiply-shift of the hash, not a power-of-two mask), grown at 80% load (doubled up to
//! 65,536 slots, then by 1.5x) and shrunk below 25%, with backward-shift deletion (no
//! tombstones). Past 65,536 slots the load stays between about 53% and 80%: 20-30 bytes per
//! block, where a power-of-two SwissTable swings between 19 and 39.

use super::depth::Depths;
use super::holders::Slab;
use crate::error::{Error, Result};

/// The parent tag of a chain's first block (`parent_block_hash` None).
pub const ROOT_TAG: u32 = 0;

/// The table hash of a block hash: fold the high half in, then one multiply (the home slot
/// comes from the top bits; block hashes are already uniform, and small or sequential ints
/// still spread).
#[inline(always)]
pub fn mix(k: u64) -> u64 {
    (k ^ (k >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// The 32-bit tag of a parent hash (never [`ROOT_TAG`] for a real parent): both halves
/// folded, the same function the Redis index stores.
#[inline(always)]
pub fn parent_tag(parent: Option<u64>) -> u32 {
    match parent {
        None => ROOT_TAG,
        Some(p) => ((p >> 32) as u32 ^ (p as u32).rotate_left(13)).max(1),
    }
}

/// Ask the kernel to back a large, not yet touched slot array with transparent huge pages:
/// a lookup probes one random slot per block, and on 4 KiB pages each probe of a table of
/// hundreds of MB is a TLB miss (a page walk) on top of its cache miss. A hint: nothing
/// changes if the kernel declines (THP off, no huge page free).
pub(crate) fn huge_pages(addr: usize, len: usize) {
    const HUGE: usize = 2 << 20;
    if len < 4 * HUGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: std::ffi::c_int) -> std::ffi::c_int;
        }
        const MADV_HUGEPAGE: std::ffi::c_int = 14;
        // the whole 2 MiB pages inside the allocation
        let start = (addr + HUGE - 1) & !(HUGE - 1);
        let end = (addr + len) & !(HUGE - 1);
        if end > start {
            // SAFETY: the range lies inside an allocation this table owns; MADV_HUGEPAGE
            // only changes how the kernel backs it, never its contents or validity.
            unsafe { madvise(start as *mut std::ffi::c_void, end - start, MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = addr;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    pub key: u64,
    pub tag: u32,
    /// An instance id, or `MULTI | slab slot`; [`EMPTY`] for a free slot.
    pub set: u32,
}

/// The set word of a free slot (a slab slot the slab never hands out).
pub const EMPTY: u32 = u32::MAX;

const FREE: Node = Node { key: 0, tag: 0, set: EMPTY };
const MIN_CAP: usize = 16;
/// Below this many slots a table doubles when it grows.
const SMALL: usize = 1 << 16;

#[derive(Debug, Default)]
pub struct Table {
    slots: Vec<Node>,
    len: usize,
    /// Some hash has had nodes under two parent tags at once (a collision or bad input):
    /// scans for a hash go to the end of its run. Never set by vLLM's own streams, whose
    /// scans stop at the hash's node.
    dups: bool,
    /// The eviction clock's hand: the slot a capped index's next eviction sweep starts at.
    hand: usize,
    /// Chain depths, kept only while the index is capped (empty otherwise): `depth[i]` for
    /// slot `i` (0: a free slot), and the (block, holder) pairs at each depth. See
    /// [`super::depth`].
    depth: Depths,
}

/// What one eviction sweep of a table did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// (block, holder) pairs dropped.
    pub pairs: usize,
    /// Nodes deleted.
    pub nodes: usize,
    /// The hand went once round the table: no more eligible node in it.
    pub exhausted: bool,
}

impl Table {
    /// Nodes (distinct (hash, parent tag) pairs).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn allocation_size(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Node>() + self.depth.allocation_size()
    }

    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        ((mix(key) as u128 * self.slots.len() as u128) >> 64) as usize
    }

    #[inline(always)]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    fn max_len(cap: usize) -> usize {
        cap / 5 * 4 + (cap % 5) * 4 / 5
    }

    /// Rebuild with `cap` slots (at least `len / 0.8`).
    fn rebuild(&mut self, cap: usize) -> Result<()> {
        let cap = cap.max(MIN_CAP);
        let mut slots = Vec::new();
        slots.try_reserve_exact(cap).map_err(|_| Error::Memory("cannot grow the prefix index".into()))?;
        huge_pages(slots.as_ptr() as usize, cap * std::mem::size_of::<Node>());
        let old_depth = self.depth.resized(cap)?;
        slots.resize(cap, FREE);
        let old = std::mem::replace(&mut self.slots, slots);
        for (j, n) in old.into_iter().enumerate().filter(|(_, n)| n.set != EMPTY) {
            self.place(n, old_depth.get(j).copied().unwrap_or(0));
        }
        Ok(())
    }

    /// Put `n` (at chain depth `d`) in the first free slot from its home (room must exist).
    fn place(&mut self, n: Node, d: u8) {
        let mut i = self.home(n.key);
        while self.slots[i].set != EMPTY {
            i = self.next(i);
        }
        self.slots[i] = n;
        self.depth.put(i, d);
    }

    /// Make room for `n` more nodes.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        let need = self.len.saturating_add(n);
        if self.slots.is_empty() || need > Self::max_len(self.slots.len()) {
            // double while small (fewer rebuilds), then 1.5x (a fuller table)
            let cap = self.slots.len();
            let grown = if cap < SMALL { cap.saturating_mul(2) } else { cap.saturating_mul(3) / 2 };
            let cap = grown.max(need.saturating_mul(5) / 4 + 1);
            self.rebuild(cap)?;
        }
        Ok(())
    }

    /// Shrink a table left below a quarter full (after evictions or a cleared instance).
    pub fn maybe_shrink(&mut self) {
        let cap = self.slots.len();
        if cap > MIN_CAP * 4 && self.len < cap / 4 {
            // rebuilding into fewer slots only fails for memory: keep the big table then
            let _ = self.rebuild(self.len * 5 / 3 + 1);
        }
    }

    /// The holders of `key` under parent tag `tag`.
    #[inline(always)]
    pub fn get(&self, key: u64, tag: u32) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let mut i = self.home(key);
        loop {
            let n = self.slots[i];
            if n.set == EMPTY {
                return None;
            }
            if n.key == key && n.tag == tag {
                return Some(n.set);
            }
            i = self.next(i);
        }
    }

    /// Start loading the home slot of `key` (a hint: see [`crate::prefetch`]).
    #[inline(always)]
    pub fn prefetch(&self, key: u64) {
        if !self.slots.is_empty() {
            crate::prefetch::prefetch(&self.slots[self.home(key)]);
        }
    }

    /// Delete slot `i` by shifting back the nodes of its run that may move closer to home.
    fn delete_at(&mut self, mut i: usize) {
        let cap = self.slots.len();
        let mut j = self.next(i);
        while self.slots[j].set != EMPTY {
            let h = self.home(self.slots[j].key);
            // the node at j may fill the hole at i if its home is not in (i, j]
            let dist_home = (j + cap - h) % cap;
            let dist_hole = (j + cap - i) % cap;
            if dist_home >= dist_hole {
                self.slots[i] = self.slots[j];
                self.depth.shift(j, i);
                i = j;
            }
            j = self.next(j);
        }
        self.slots[i] = FREE;
        self.depth.put(i, 0);
        self.len -= 1;
    }

    /// `inst` holds `key` under `tag` (and under no other tag). Returns the change in the
    /// number of (block, holder) pairs: +1 if new, 0 if it already held it, and one less per
    /// other tag it is dropped from. `depth` is the block's chain depth (kept only while the
    /// index tracks depths; a node keeps the smallest depth it was stored at). Room must be
    /// reserved first ([`Table::reserve`], [`Slab::reserve`]).
    pub fn store(&mut self, key: u64, tag: u32, inst: u32, depth: u8, slab: &mut Slab) -> isize {
        let mut delta = 0isize;
        let mut found = false;
        let mut emptied = false;
        let mut other_kept = false;
        let mut i = self.home(key);
        loop {
            let n = &mut self.slots[i];
            if n.set == EMPTY {
                break;
            }
            if n.key == key {
                if n.tag == tag {
                    found = true;
                    let (set, added) = slab.insert(n.set, inst);
                    n.set = set;
                    delta += added as isize;
                    if self.depth.on() {
                        let pairs = slab.count(set);
                        self.depth.restore(i, depth, pairs, added as usize);
                    }
                    if !self.dups {
                        // the only node of this hash
                        return delta;
                    }
                } else {
                    let (set, held) = slab.remove(n.set, inst);
                    delta -= held as isize;
                    self.depth.lose(i, held as usize);
                    match set {
                        Some(s) => {
                            n.set = s;
                            other_kept = true;
                        }
                        None => emptied = true,
                    }
                }
            }
            i = self.next(i);
        }
        if !found {
            // the free slot that ended the run (reserve guarantees one)
            self.slots[i] = Node { key, tag, set: inst };
            self.depth.put(i, depth);
            self.depth.gain(i, 1);
            self.len += 1;
            delta += 1;
            if other_kept {
                self.dups = true;
            }
        }
        if emptied {
            self.drop_emptied(key, inst, Some(tag));
        }
        delta
    }

    /// Delete the nodes of `key` (other than the one tagged `keep`) whose last holder
    /// `inst` was just removed (their set word still names it).
    fn drop_emptied(&mut self, key: u64, inst: u32, keep: Option<u32>) {
        loop {
            let mut i = self.home(key);
            let mut hit = None;
            while self.slots[i].set != EMPTY {
                let n = self.slots[i];
                if n.key == key && n.set == inst && Some(n.tag) != keep {
                    hit = Some(i);
                    break;
                }
                i = self.next(i);
            }
            match hit {
                Some(i) => self.delete_at(i),
                None => return,
            }
        }
    }

    /// `inst` no longer holds `key` (under any tag). Returns the pairs removed.
    pub fn remove(&mut self, key: u64, inst: u32, slab: &mut Slab) -> usize {
        if self.slots.is_empty() {
            return 0;
        }
        let mut removed = 0;
        let mut emptied = false;
        let mut i = self.home(key);
        loop {
            let n = &mut self.slots[i];
            if n.set == EMPTY {
                break;
            }
            if n.key == key {
                let (set, held) = slab.remove(n.set, inst);
                removed += held as usize;
                self.depth.lose(i, held as usize);
                match set {
                    Some(s) => n.set = s,
                    None => {
                        if !self.dups {
                            // the only node of this hash
                            self.delete_at(i);
                            return removed;
                        }
                        emptied = true
                    }
                }
                if !self.dups {
                    return removed;
                }
            }
            i = self.next(i);
        }
        if emptied {
            self.drop_emptied(key, inst, None);
        }
        removed
    }

    /// The eviction clock: from the hand on, delete whole nodes (every holder of the block)
    /// until `want` pairs are dropped or the hand has gone once round; nodes held by more
    /// than one instance are skipped unless `shared`. `on_drop(key, set, slab)` sees each
    /// deleted node before its holder set is released. Deleting only ever makes the index
    /// under-report (a lookup stops at the missing block), never over-report.
    pub fn evict(
        &mut self,
        want: usize,
        shared: bool,
        slab: &mut Slab,
        mut on_drop: impl FnMut(u64, u32, &Slab),
    ) -> Swept {
        let cap = self.slots.len();
        let mut out = Swept::default();
        if cap == 0 || self.len == 0 {
            out.exhausted = true;
            return out;
        }
        let mut i = self.hand % cap;
        let mut seen = 0;
        while out.pairs < want {
            if seen >= cap || self.len == 0 {
                out.exhausted = true;
                break;
            }
            let n = self.slots[i];
            if n.set != EMPTY && (shared || n.set & super::holders::MULTI == 0) {
                out.pairs += slab.count(n.set);
                out.nodes += 1;
                on_drop(n.key, n.set, slab);
                slab.drop_set(n.set);
                // slot i now holds a node shifted back into it (or nothing): look again
                self.delete_at(i);
                continue;
            }
            i = self.next(i);
            seen += 1;
        }
        self.hand = i;
        out
    }

    /// Keep chain depths (`depths`: a depth per slot, from [`Self::slot_nodes`]' order) or
    /// stop (None). Fails only for memory, tracking nothing then.
    pub fn track_depths(&mut self, depths: Option<Vec<u8>>, slab: &Slab) -> Result<()> {
        let Some(d) = depths else { return self.depth.track(None) };
        if let Err(e) = self.depth.track(Some(self.slots.len())) {
            self.depth.track(None)?;
            return Err(e);
        }
        for (i, x) in d.into_iter().enumerate().take(self.slots.len()) {
            if self.slots[i].set != EMPTY {
                self.depth.put(i, x);
            }
        }
        let slots = &self.slots;
        self.depth.recount(|i| (slots[i].set != EMPTY).then(|| slab.count(slots[i].set)));
        Ok(())
    }

    /// Tracking chain depths?
    pub fn tracks_depths(&self) -> bool {
        self.depth.on()
    }

    /// Every slot's node (None: free), in slot order.
    pub fn slot_nodes(&self) -> impl Iterator<Item = Option<&Node>> {
        self.slots.iter().map(|n| (n.set != EMPTY).then_some(n))
    }

    /// The smallest depth of a node of `key` (under any parent), if the table has one and
    /// tracks depths.
    pub fn depth_of(&self, key: u64) -> Option<u8> {
        if !self.depth.on() || self.slots.is_empty() {
            return None;
        }
        let mut best = None;
        let mut i = self.home(key);
        while self.slots[i].set != EMPTY {
            if self.slots[i].key == key {
                let d = self.depth.at(i);
                best = Some(best.map_or(d, |b: u8| b.min(d)));
                if !self.dups {
                    break;
                }
            }
            i = self.next(i);
        }
        best
    }

    /// (block, holder) pairs at chain depth `d` (0 when not tracking depths).
    pub fn pairs_at_depth(&self, d: u8) -> usize {
        self.depth.pairs_at(d)
    }

    /// The depth-ordered eviction (the table tracks depths): from the hand on, delete every
    /// node deeper than `cut`, and nodes at depth `cut` while `budget` (pairs) lasts, taking
    /// it down by each one's holders; stops when both are done or the hand has gone once
    /// round. `on_drop(key, set, slab)` sees each deleted node before its set is released.
    pub fn evict_deep(
        &mut self,
        cut: u8,
        budget: &mut usize,
        slab: &mut Slab,
        mut on_drop: impl FnMut(u64, u32, &Slab),
    ) -> Swept {
        let cap = self.slots.len();
        let mut out = Swept::default();
        let mut deeper: usize = (cut as usize + 1..256).map(|d| self.depth.pairs_at(d as u8)).sum();
        if cap == 0 || self.len == 0 || !self.depth.on() {
            out.exhausted = true;
            return out;
        }
        let mut i = self.hand % cap;
        let mut seen = 0;
        while deeper > 0 || (*budget > 0 && self.depth.pairs_at(cut) > 0) {
            if seen >= cap || self.len == 0 {
                out.exhausted = true;
                break;
            }
            let d = self.depth.slots()[i];
            // free slots are depth 0, never at or past a cut (>= 2)
            if d > cut || (d == cut && *budget > 0) {
                let n = self.slots[i];
                let pairs = slab.count(n.set);
                if d > cut {
                    deeper = deeper.saturating_sub(pairs);
                } else {
                    *budget = budget.saturating_sub(pairs);
                }
                self.depth.lose(i, pairs);
                out.pairs += pairs;
                out.nodes += 1;
                on_drop(n.key, n.set, slab);
                slab.drop_set(n.set);
                self.delete_at(i);
                continue;
            }
            i = self.next(i);
            seen += 1;
        }
        self.hand = i;
        out
    }

    /// Drop `inst` from every block. Returns the pairs removed.
    pub fn clear_instance(&mut self, inst: u32, slab: &mut Slab) -> usize {
        let mut removed = 0;
        let mut kept = 0;
        for (i, n) in self.slots.iter_mut().enumerate().filter(|(_, n)| n.set != EMPTY) {
            let (set, held) = slab.remove(n.set, inst);
            removed += held as usize;
            self.depth.lose(i, held as usize);
            match set {
                Some(s) => {
                    n.set = s;
                    kept += 1;
                }
                None => *n = FREE,
            }
        }
        if removed > 0 {
            // holes break the probe runs: re-place every node (into a smaller table if due)
            self.len = kept;
            let cap = if kept < self.slots.len() / 4 { kept * 5 / 3 + 1 } else { self.slots.len() };
            if self.rebuild(cap).is_err() {
                // no memory for a new array: re-place in the old one
                let nodes: Vec<(Node, u8)> = (0..self.slots.len())
                    .filter(|&i| self.slots[i].set != EMPTY)
                    .map(|i| (self.slots[i], self.depth.at(i)))
                    .collect();
                self.slots.fill(FREE);
                self.depth.clear_slots();
                for (n, d) in nodes {
                    self.place(n, d);
                }
            }
        }
        removed
    }

    /// Every (hash, parent tag) `inst` holds.
    pub fn blocks_of(&self, inst: u32, slab: &Slab) -> Vec<(u64, u32)> {
        self.iter().filter(|n| slab.contains(n.set, inst)).map(|n| (n.key, n.tag)).collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Node> {
        self.slots.iter().filter(|n| n.set != EMPTY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_delete_keeps_every_key_reachable() {
        let mut t = Table::default();
        let mut slab = Slab::new();
        let mut live = std::collections::HashSet::new();
        let mut x = 7u64;
        for step in 0..20_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let key = x % 3000; // many collisions of small keys
            if step % 3 == 2 {
                t.remove(key, 0, &mut slab);
                live.remove(&key);
            } else {
                t.reserve(1).unwrap();
                t.store(key, 5, 0, 2, &mut slab);
                live.insert(key);
            }
            if step % 1000 == 0 {
                t.maybe_shrink();
            }
        }
        assert_eq!(t.len(), live.len());
        for k in 0..3000 {
            assert_eq!(t.get(k, 5).is_some(), live.contains(&k), "key {k}");
        }
        let load = t.len() as f64 / t.slots.len() as f64;
        assert!(load <= 0.8 + 1e-9, "load {load}");
        assert_eq!(t.clear_instance(0, &mut slab), live.len());
        assert!(t.is_empty() && t.get(1, 5).is_none());
    }
}
