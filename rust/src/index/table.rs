//! One medium's blocks: 64-bit block hash -> (parent tag, holder set), in a chain arena.
//!
//! Each [`Node`] carries a 32-bit tag of the parent hash its holders reported, so a lookup
//! that walks a request's chain only follows a block whose parent is the chain's previous
//! block. An instance holds a hash under one parent (its latest `BlockStored`); a hash stored
//! by different instances under different parents (a 64-bit collision, or bad input) gets
//! one node per parent tag.
//!
//! Layout: the nodes (16 bytes: key, parent tag, holder set) live in an arena in the order
//! they were first stored, so the blocks of one `BlockStored` run (each stored under the one
//! before it) sit next to each other; a dead node (every holder gone) keeps its place with
//! the set word [`EMPTY`] until a compaction slides the live ones down (order kept). An
//! index maps a hash to its node: open addressing with linear probing over 8-byte slots
//! (the top 32 bits of the hash's mix, which also give its home slot, and the node's arena
//! position), any capacity (multiply-shift home), grown at 80% load and shrunk below 25%,
//! backward-shift deletion (no tombstones). A lookup walking a chain probes the index where
//! a run starts and then reads the arena's next nodes ([`Table::run_len`], [`Table::at`]): a
//! hit when its key and tag are the query's next block and parent (a node is unique per
//! (key, tag), so the answer is the one a probe gives), contiguous memory the hardware
//! streams in. Chains stored in small batches interleaved with others' are laid out in
//! chain order when the arena grows (`Table::relayout`) and, for the nodes stored since,
//! every 32Ki nodes in place (`Table::settle`, which knows each young node's index slot
//! and rewrites it without a probe; growth builds the bigger index from the old one in slot
//! order); a table records where its nodes moved ([`Table::take_moves`]) for another
//! table's hints into it (a roots table's). Storing follows the arena the same way: a block
//! already held under the block before it (another holder's copy of the chain) is right
//! after that block's node or at its hint ([`Table::store_at`]), and needs no probe.

use super::depth::Depths;
use super::holders::{Slab, EMPTY};
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    pub key: u64,
    pub tag: u32,
    /// An instance id, or `MULTI | slab slot`; [`EMPTY`] for a dead node.
    pub set: u32,
}

/// No continuation hint.
const NO_NEXT: u32 = u32::MAX;

/// How far ahead (nodes) [`Table::run_len`] requests the arena, the nodes hints name, and
/// a differing holder bitset.
const RUN_AHEAD: usize = 32;
const HINT_RUN_AHEAD: usize = 64;
const SET_AHEAD: usize = 16;

/// The young nodes are laid out in chain order (`Table::settle`) once there are this
/// many, if at least `SETTLE_LINKS` runs among them were stored apart from their chain.
/// (Small under test, so that every test's tables settle.)
const SETTLE_NODES: usize = if cfg!(test) { 256 } else { 32 << 10 };
const SETTLE_LINKS: usize = if cfg!(test) { 4 } else { 256 };
/// How far ahead [`Table::settle`] requests index slots.
const SETTLE_AHEAD: usize = 16;

/// A free index slot.
const FREE_SLOT: u64 = u64::MAX;
/// A young node's index slot, not known.
const NO_SLOT: u32 = u32::MAX;
const MIN_CAP: usize = 16;
/// Below this many index slots an index doubles when it grows.
const SMALL: usize = 1 << 16;
/// Most nodes an arena holds (positions are `u32`, `u32::MAX` never used).
const MAX_NODES: usize = u32::MAX as usize - 1;

// an arena's allocation holds two index slots per node
const _: () = assert!(std::mem::size_of::<Node>() == 16 && std::mem::align_of::<Node>() == 8);

/// The allocation of an arena no longer needed, as an empty vector of index slots (two per
/// node of its capacity).
fn slots_in(nodes: Vec<Node>) -> Vec<u64> {
    let mut nodes = std::mem::ManuallyDrop::new(nodes);
    let (ptr, cap) = (nodes.as_mut_ptr(), nodes.capacity());
    // SAFETY: the allocation (from the global allocator, `cap * 16` bytes, align 8: the
    // layout of `[Node; cap]`) is the layout of `[u64; 2 * cap]`; the vector starts empty
    // (nothing read from the old bytes) and owns the allocation alone (`nodes` forgotten).
    unsafe { Vec::from_raw_parts(ptr as *mut u64, 0, cap * 2) }
}

/// The 32-bit fingerprint of a key (the top of its mix; it also picks the home slot).
#[inline(always)]
fn fp(key: u64) -> u32 {
    (mix(key) >> 32) as u32
}

#[derive(Debug, Default)]
pub struct Table {
    /// The arena, in first-store order (dead nodes: set [`EMPTY`]).
    nodes: Vec<Node>,
    /// Per arena position, a hint: the arena position of the node last stored under this
    /// one when that did not go right after it (a run stored later under a run's last
    /// block), [`NO_NEXT`] for none. Only ever a hint: the walk checks the node it names.
    next: Vec<u32>,
    /// Open addressing: `fingerprint << 32 | arena position`, [`FREE_SLOT`] for none.
    index: Vec<u64>,
    /// Live nodes.
    len: usize,
    /// Dead nodes in the arena.
    dead: usize,
    /// Some hash has had nodes under two parent tags at once (a collision or bad input):
    /// scans for a hash go to the end of its run. Never set by vLLM's own streams, whose
    /// scans stop at the hash's node.
    dups: bool,
    /// The eviction clock's hand: the arena position a capped index's next eviction sweep
    /// starts at.
    hand: usize,
    /// The arena position from which nodes were stored since the arena was last laid out
    /// in chain order (by [`Self::relayout`] or [`Self::settle`]).
    young: usize,
    /// Hints set since then (runs stored apart from the block they continue).
    links: usize,
    /// Positions before `young` whose hint was set since then (to carry over when the young
    /// nodes move).
    into_young: Vec<u32>,
    /// Per young node (arena position `young + k`), the index slot that names it (kept as
    /// slots move; [`NO_SLOT`]: not known), so that [`Self::settle`] rewrites each moved
    /// node's slot without probing the index for it. Shorter than the young nodes when its
    /// memory could not be had (settling probes for the rest then).
    young_slot: Vec<u32>,
    /// The hints name positions in another table (a roots table's: where a chain's second
    /// block went in its medium's table): they move with their nodes unchanged, and
    /// laying this arena out never follows them.
    pub foreign_hints: bool,
    /// Keep the moves of nodes (for another table's hints into this one) until
    /// [`Self::take_moves`].
    pub record_moves: bool,
    moves: Moves,
    /// Tests that look at the layout growth makes turn [`Self::settle`] off.
    #[cfg(test)]
    no_settle: bool,
    /// Chain depths, kept only while the index is capped (empty otherwise): `depth[p]` for
    /// arena position `p` (0: a dead node), and the (block, holder) pairs at each depth. See
    /// [`super::depth`].
    depth: Depths,
}

/// Nodes moved since [`Table::take_moves`] last asked.
#[derive(Debug, Default)]
pub enum Moves {
    #[default]
    None,
    /// Position `p >= .0` went to `.1[p - .0]` ([`u32::MAX`]: dropped); those below stayed.
    Map(usize, Vec<u32>),
    /// Moved, not known where (more than one move since asked, or no memory for the map).
    Lost,
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
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.next.capacity() * std::mem::size_of::<u32>()
            + self.index.capacity() * std::mem::size_of::<u64>()
            + self.young_slot.capacity() * std::mem::size_of::<u32>()
            + self.depth.allocation_size()
    }

    #[inline(always)]
    fn home_of(f: u32, cap: usize) -> usize {
        ((f as u64 * cap as u64) >> 32) as usize
    }

    #[inline(always)]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.index.len() {
            0
        } else {
            i + 1
        }
    }

    fn max_len(cap: usize) -> usize {
        cap / 5 * 4 + (cap % 5) * 4 / 5
    }

    /// Put arena position `p` (fingerprint `f`) in the first free index slot from its home;
    /// returns that slot.
    #[inline(always)]
    fn place(index: &mut [u64], f: u32, p: usize) -> usize {
        let cap = index.len();
        let mut i = Self::home_of(f, cap);
        while index[i] != FREE_SLOT {
            i = if i + 1 == cap { 0 } else { i + 1 };
        }
        index[i] = (f as u64) << 32 | p as u64;
        i
    }

    /// Start keeping the young nodes' index slots afresh (all unknown); false without the
    /// memory for it (they stay unknown).
    fn young_slots_unknown(&mut self) -> bool {
        let m = self.nodes.len().saturating_sub(self.young);
        self.young_slot.clear();
        if self.young_slot.try_reserve(m).is_err() {
            return false;
        }
        self.young_slot.resize(m, NO_SLOT);
        true
    }

    /// Rebuild the index with `cap` slots (at least `len / 0.8`) from the arena.
    fn reindex(&mut self, cap: usize) -> Result<()> {
        let cap = cap.max(MIN_CAP);
        let oom = |_| Error::Memory("cannot grow the prefix index".into());
        if cap != self.index.len() {
            let mut index = Vec::new();
            index.try_reserve_exact(cap).map_err(oom)?;
            crate::huge_pages::advise(index.as_ptr() as usize, cap * std::mem::size_of::<u64>());
            index.resize(cap, FREE_SLOT);
            let old = std::mem::replace(&mut self.index, index);
            if !old.is_empty() {
                self.place_from(&old, None);
                return Ok(());
            }
        } else {
            self.index.fill(FREE_SLOT);
        }
        self.place_all();
        Ok(())
    }

    /// Put every live node in the (empty) index.
    fn place_all(&mut self) {
        let cap = self.index.len();
        let (y, track) = (self.young, self.young_slots_unknown());
        // one random slot per node: each requested ahead
        for p in 0..self.nodes.len() {
            if let Some(a) = self.nodes.get(p + SETTLE_AHEAD) {
                crate::prefetch::prefetch(&self.index[Self::home_of(fp(a.key), cap)]);
            }
            let n = self.nodes[p];
            if n.set != EMPTY {
                let i = Self::place(&mut self.index, fp(n.key), p);
                if track && p >= y {
                    self.young_slot[p - y] = u32::try_from(i).unwrap_or(NO_SLOT);
                }
            }
        }
    }

    /// Fill the (empty) index from `old`, an index of the same live nodes (of another size),
    /// each position mapped through `map` (None: unchanged). `old` is read in slot order,
    /// which is the order of the homes in either size (a home is the fingerprint scaled to
    /// the size), so the writes go forward through the new index, where placing node by
    /// node writes one random slot each; only `map` is read at random (4 bytes a node,
    /// requested ahead).
    fn place_from(&mut self, old: &[u64], map: Option<&[u32]>) {
        let (y, track) = (self.young, self.young_slots_unknown());
        for k in 0..old.len() {
            if let (Some(m), Some(&a)) = (map, old.get(k + SETTLE_AHEAD)) {
                if let Some(x) = m.get(a as u32 as usize) {
                    crate::prefetch::prefetch(x);
                }
            }
            let v = old[k];
            if v == FREE_SLOT {
                continue;
            }
            let p = match map {
                None => v as u32 as usize,
                Some(m) => match m.get(v as u32 as usize) {
                    Some(&q) if q != NO_NEXT => q as usize,
                    // (every live node has a new position)
                    _ => continue,
                },
            };
            let i = Self::place(&mut self.index, (v >> 32) as u32, p);
            if track && p >= y {
                if let Some(x) = self.young_slot.get_mut(p - y) {
                    *x = u32::try_from(i).unwrap_or(NO_SLOT);
                }
            }
        }
    }

    /// Slide the live nodes down over the dead ones (order kept), then rebuild the index in
    /// place. Never fails.
    fn compact(&mut self) {
        // old position -> new (NO_NEXT: dead), to carry the hints over; without the memory
        // for it the hints are dropped (they are only hints)
        let mut moved: Vec<u32> = Vec::new();
        let remap = moved.try_reserve_exact(self.nodes.len()).is_ok();
        let mut w = 0;
        let mut young = None;
        for r in 0..self.nodes.len() {
            if r == self.young {
                young = Some(w);
            }
            let n = self.nodes[r];
            if n.set != EMPTY {
                if remap {
                    moved.push(w as u32);
                }
                if w != r {
                    self.nodes[w] = n;
                    self.next[w] = self.next[r];
                    self.depth.shift(r, w);
                }
                w += 1;
            } else if remap {
                moved.push(NO_NEXT);
            }
        }
        for p in w..self.nodes.len() {
            self.depth.put(p, 0);
        }
        self.nodes.truncate(w);
        self.next.truncate(w);
        self.young = young.unwrap_or(w);
        if !remap {
            self.laid_out();
        }
        if !self.foreign_hints {
            for x in &mut self.next {
                if *x != NO_NEXT {
                    *x = if remap { moved.get(*x as usize).copied().unwrap_or(NO_NEXT) } else { NO_NEXT };
                }
            }
        }
        if remap {
            for q in &mut self.into_young {
                *q = moved.get(*q as usize).copied().unwrap_or(NO_NEXT);
            }
            self.into_young.retain(|&q| q != NO_NEXT);
        }
        self.moved(0, remap.then_some(moved));
        self.dead = 0;
        self.hand = 0;
        let cap = self.index.len();
        // the same size: an in-place rebuild that allocates nothing
        let _ = self.reindex(cap);
    }

    /// Grow the arena to `cap` nodes, writing the live ones in chain order: each run
    /// followed by the run stored under its last block (its continuation hint), so a chain
    /// stored in many small `BlockStored` batches, interleaved with other instances', reads
    /// as one contiguous stretch afterwards; then re-index. Dead nodes go. Fails only for
    /// memory (nothing changed then).
    fn relayout(&mut self, cap: usize) -> Result<()> {
        let oom = |_| Error::Memory("cannot grow the prefix index".into());
        let n = self.nodes.len();
        let cap = cap.max(self.len);
        let mut nodes: Vec<Node> = Vec::new();
        nodes.try_reserve_exact(cap).map_err(oom)?;
        crate::huge_pages::advise(nodes.as_ptr() as usize, cap * std::mem::size_of::<Node>());
        let mut next: Vec<u32> = Vec::new();
        next.try_reserve_exact(cap).map_err(oom)?;
        let mut moved: Vec<u32> = Vec::new();
        moved.try_reserve_exact(n).map_err(oom)?;
        moved.resize(n, NO_NEXT);
        // an index sized for the new arena full at 80% (it grows with the arena, one rebuild)
        let icap = (cap.saturating_mul(5) / 4 + 1).max(self.index.len()).max(MIN_CAP);
        let mut index: Vec<u64> = Vec::new();
        // the new index goes where the old arena was when that has room (its pages are
        // already the process's: no fresh pages for the kernel to zero)
        let reuse = icap != self.index.len() && icap <= self.nodes.capacity() * 2;
        if icap != self.index.len() && !reuse {
            index.try_reserve_exact(icap).map_err(oom)?;
            crate::huge_pages::advise(index.as_ptr() as usize, icap * std::mem::size_of::<u64>());
        }
        let old_depth = self.depth.resized(cap)?;
        let old = &self.nodes;
        for start in 0..n {
            if old[start].set == EMPTY || moved[start] != NO_NEXT {
                continue;
            }
            let mut p = start;
            loop {
                moved[p] = nodes.len() as u32;
                nodes.push(old[p]);
                next.push(self.next[p]);
                // the successor: the node after it if it is its child, else the hinted one
                let tag = parent_tag(Some(old[p].key));
                let child = |c: usize| c < n && old[c].set != EMPTY && old[c].tag == tag && moved[c] == NO_NEXT;
                p = if child(p + 1) {
                    p + 1
                } else if !self.foreign_hints && child(self.next[p] as usize) {
                    self.next[p] as usize
                } else {
                    break;
                };
            }
        }
        if !self.foreign_hints {
            for x in &mut next {
                if *x != NO_NEXT {
                    *x = moved.get(*x as usize).copied().unwrap_or(NO_NEXT);
                }
            }
        }
        for (p, &m) in moved.iter().enumerate() {
            if m != NO_NEXT {
                self.depth.put(m as usize, old_depth.get(p).copied().unwrap_or(0));
            }
        }
        let old_nodes = std::mem::replace(&mut self.nodes, nodes);
        if reuse {
            index = slots_in(old_nodes);
        }
        self.next = next;
        self.dead = 0;
        self.hand = 0;
        self.laid_out();
        if icap != self.index.len() {
            // built from the old index (both held for a while: one index more at the peak)
            index.resize(icap, FREE_SLOT);
            let old = std::mem::replace(&mut self.index, index);
            self.place_from(&old, Some(&moved));
        } else {
            self.index.fill(FREE_SLOT);
            self.place_all();
        }
        self.moved(0, Some(moved));
        Ok(())
    }

    /// Record a move (positions from `y` on went to `map`).
    fn moved(&mut self, y: usize, map: Option<Vec<u32>>) {
        if self.record_moves {
            self.moves = match (std::mem::take(&mut self.moves), map) {
                (Moves::None, Some(m)) => Moves::Map(y, m),
                (Moves::Map(y1, m1), Some(m2)) => Self::compose(y1, &m1, y, &m2),
                _ => Moves::Lost,
            };
        }
    }

    /// The moves `(y1, m1)` then `(y2, m2)` as one (positions past `m1`'s: nodes stored
    /// between the two).
    fn compose(y1: usize, m1: &[u32], y2: usize, m2: &[u32]) -> Moves {
        let (base, end) = (y1.min(y2), (y1 + m1.len()).max(y2 + m2.len()));
        let mut out: Vec<u32> = Vec::new();
        if out.try_reserve_exact(end.saturating_sub(base)).is_err() {
            return Moves::Lost;
        }
        for p in base..end {
            let q = if p >= y1 { m1.get(p - y1).copied().unwrap_or(p as u32) } else { p as u32 };
            out.push(match q {
                NO_NEXT => NO_NEXT,
                q if q as usize >= y2 => m2.get(q as usize - y2).copied().unwrap_or(NO_NEXT),
                q => q,
            });
        }
        Moves::Map(base, out)
    }

    /// The nodes moved since last asked (then forgotten).
    pub fn take_moves(&mut self) -> Moves {
        std::mem::take(&mut self.moves)
    }

    /// Set the (foreign) hint of position `q` to `a`.
    #[inline(always)]
    pub fn set_hint(&mut self, q: usize, a: usize) {
        if let Some(x) = self.next.get_mut(q) {
            *x = a as u32;
        }
    }

    /// The table the (foreign) hints name moved its nodes: carry the hints over.
    pub fn remap_hints(&mut self, moves: &Moves) {
        match moves {
            Moves::None => {}
            Moves::Map(y, map) => {
                for x in &mut self.next {
                    if *x != NO_NEXT && *x as usize >= *y {
                        *x = map.get(*x as usize - y).copied().unwrap_or(NO_NEXT);
                    }
                }
            }
            Moves::Lost => self.next.fill(NO_NEXT),
        }
    }

    /// Every node is where the chain-order layout put it.
    fn laid_out(&mut self) {
        self.young = self.nodes.len();
        self.links = 0;
        self.into_young.clear();
        self.young_slot.clear();
        if self.young_slot.capacity() > 4 * SETTLE_NODES {
            self.young_slot = Vec::new();
        }
    }

    /// Note that index slot `i` now names arena position `p`.
    #[inline(always)]
    fn slot_moved(&mut self, p: usize, i: usize) {
        if let Some(x) = p.checked_sub(self.young).and_then(|k| self.young_slot.get_mut(k)) {
            *x = u32::try_from(i).unwrap_or(NO_SLOT);
        }
    }

    /// Lay the young nodes (those stored since the last layout) out in chain order, in
    /// place: each run followed by the run stored under its last block, as
    /// [`Self::relayout`] does for the whole arena, so that chains stored in small batches
    /// interleaved with other instances' read contiguously without waiting for the arena's
    /// next growth. Dead young nodes go. Moves only young nodes (their index slots are
    /// rewritten; hints into them carried over). Needs scratch memory for the young nodes:
    /// without it nothing changes (the layout is only an optimization).
    fn settle(&mut self) {
        let (y, n) = (self.young, self.nodes.len());
        let m = n - y;
        let mut order: Vec<u32> = Vec::new();
        let mut moved: Vec<u32> = Vec::new();
        let mut slots: Vec<usize> = Vec::new();
        let mut nodes: Vec<Node> = Vec::new();
        let mut next: Vec<u32> = Vec::new();
        let mut depth: Vec<u8> = Vec::new();
        if order.try_reserve_exact(m).is_err()
            || moved.try_reserve_exact(m).is_err()
            || slots.try_reserve_exact(m).is_err()
            || nodes.try_reserve_exact(m).is_err()
            || next.try_reserve_exact(m).is_err()
            || (self.depth.on() && depth.try_reserve_exact(m).is_err())
        {
            self.laid_out();
            return;
        }
        moved.resize(m, NO_NEXT);
        let old = &self.nodes;
        for start in y..n {
            if old[start].set == EMPTY || moved[start - y] != NO_NEXT {
                continue;
            }
            let mut p = start;
            loop {
                moved[p - y] = (y + order.len()) as u32;
                order.push(p as u32);
                let tag = parent_tag(Some(old[p].key));
                let child =
                    |c: usize| c >= y && c < n && old[c].set != EMPTY && old[c].tag == tag && moved[c - y] == NO_NEXT;
                p = if child(p + 1) {
                    p + 1
                } else if child(self.next[p] as usize) {
                    self.next[p] as usize
                } else {
                    break;
                };
            }
        }
        // the index slot of every moved node: kept as nodes were stored, or found while the
        // index still names the old positions (a (fingerprint, position) pair is unique
        // then), requested ahead
        let cap = self.index.len();
        let ys = &self.young_slot;
        let known = ys.len() == m && order.iter().all(|&p| ys[p as usize - y] != NO_SLOT);
        for (j, &p) in order.iter().enumerate() {
            if let Some(&a) = order.get(j + SETTLE_AHEAD) {
                let home =
                    if known { ys[a as usize - y] as usize } else { Self::home_of(fp(old[a as usize].key), cap) };
                if let Some(x) = self.index.get(home) {
                    crate::prefetch::prefetch(x);
                }
            }
            let p = p as usize;
            slots.push(if p == y + j {
                usize::MAX
            } else if known {
                let s = ys[p - y] as usize;
                debug_assert_eq!(self.index[s], (fp(old[p].key) as u64) << 32 | p as u64);
                s
            } else {
                self.slot_of(p)
            });
        }
        for &p in &order {
            let p = p as usize;
            nodes.push(self.nodes[p]);
            let h = self.next[p];
            next.push(if h as usize >= y && (h as usize) < n { moved[h as usize - y] } else { h });
            if self.depth.on() {
                depth.push(self.depth.at(p));
            }
        }
        let live = order.len();
        self.dead -= m - live;
        self.nodes.truncate(y);
        self.nodes.extend_from_slice(&nodes);
        self.next.truncate(y);
        self.next.extend_from_slice(&next);
        for j in 0..m {
            self.depth.put(y + j, depth.get(j).copied().unwrap_or(0));
        }
        for (j, &s) in slots.iter().enumerate() {
            if s != usize::MAX {
                self.index[s] = (self.index[s] >> 32) << 32 | (y + j) as u64;
            }
        }
        for &q in &self.into_young {
            if let Some(x) = self.next.get_mut(q as usize) {
                if *x as usize >= y && (*x as usize) < n {
                    *x = moved[*x as usize - y];
                }
            }
        }
        if self.hand > y {
            self.hand = y;
        }
        self.laid_out();
        self.moved(y, Some(moved));
    }

    /// Make room for `n` more nodes.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        let need = self.len.saturating_add(n);
        if need > MAX_NODES {
            return Err(Error::Memory("the prefix index is full".into()));
        }
        #[cfg(test)]
        let off = self.no_settle;
        #[cfg(not(test))]
        let off = false;
        // (without room, young nodes' slots go unknown: settling probes for them)
        let _ = self.young_slot.try_reserve(n);
        if !off && self.links >= SETTLE_LINKS && self.nodes.len() - self.young >= SETTLE_NODES {
            self.settle();
        }
        if self.nodes.len() + n > self.nodes.capacity() {
            if self.dead > 0 && self.dead >= self.len / 4 && self.len + n <= self.nodes.capacity() {
                self.compact();
            } else {
                let cap = self.nodes.capacity();
                let want = (cap.saturating_mul(3) / 2).max(self.nodes.len() + n).max(MIN_CAP);
                self.relayout(want)?;
            }
        }
        self.depth.ensure(self.nodes.len() + n)?;
        if self.index.is_empty() || need > Self::max_len(self.index.len()) {
            // double while small (fewer rebuilds), then 1.5x (a fuller table)
            let cap = self.index.len();
            let grown = if cap < SMALL { cap.saturating_mul(2) } else { cap.saturating_mul(3) / 2 };
            let cap = grown.max(need.saturating_mul(5) / 4 + 1);
            self.reindex(cap)?;
        }
        Ok(())
    }

    /// Shrink a table left below a quarter full, compact an arena left more than half dead
    /// (after evictions or a cleared instance).
    pub fn maybe_shrink(&mut self) {
        if self.dead > 64 && self.dead > self.len {
            self.compact();
            if self.nodes.capacity() > 2 * self.nodes.len() + MIN_CAP {
                self.nodes.shrink_to(self.nodes.len() * 5 / 4 + MIN_CAP);
                self.next.shrink_to(self.nodes.len() * 5 / 4 + MIN_CAP);
            }
        }
        let cap = self.index.len();
        if cap > MIN_CAP * 4 && self.len < cap / 4 {
            // rebuilding into fewer slots only fails for memory: keep the big index then
            let _ = self.reindex(self.len * 5 / 3 + 1);
        }
    }

    /// The arena position of `key`'s node under parent tag `tag`.
    #[inline(always)]
    pub fn find(&self, key: u64, tag: u32) -> Option<usize> {
        if self.index.is_empty() {
            return None;
        }
        let f = fp(key);
        let mut i = Self::home_of(f, self.index.len());
        loop {
            let s = self.index[i];
            if s == FREE_SLOT {
                return None;
            }
            if (s >> 32) as u32 == f {
                let p = s as u32 as usize;
                let n = self.nodes[p];
                if n.key == key && n.tag == tag {
                    return Some(p);
                }
            }
            i = self.next(i);
        }
    }

    /// The holders of `key` under parent tag `tag`.
    #[inline(always)]
    pub fn get(&self, key: u64, tag: u32) -> Option<u32> {
        self.find(key, tag).map(|p| self.nodes[p].set)
    }

    /// The holder set of the node at arena position `p` if it is `key` under `tag`
    /// ([`EMPTY`] otherwise): the walk's contiguous step. Exact, since a table has one node
    /// per (key, tag).
    #[inline(always)]
    pub fn at(&self, p: usize, key: u64, tag: u32) -> u32 {
        match self.nodes.get(p) {
            Some(n) if n.key == key && n.tag == tag => n.set,
            _ => EMPTY,
        }
    }

    /// The contiguous walk, several blocks at once: from arena position `p` (the node of
    /// `hashes[i - 1]`), how many of `hashes[i..]` are the nodes right after it, each under
    /// the block before it and with holder set word `set` (so a walk's live instances are
    /// unchanged over them). Exact: a table has one node per (key, tag). Compares four nodes
    /// per step without a branch between them, requests the arena `RUN_AHEAD` nodes ahead,
    /// the nodes continuation hints name `HINT_RUN_AHEAD` nodes ahead, and the holder
    /// bitset of a node ahead whose set differs (the walk will gather it).
    #[inline]
    pub fn run_len(&self, p: usize, set: u32, hashes: &[u64], i: usize, slab: &Slab) -> usize {
        let start = p.wrapping_add(1);
        if i == 0 || start >= self.nodes.len() || i >= hashes.len() {
            return 0;
        }
        let avail = (self.nodes.len() - start).min(hashes.len() - i);
        let (Some(nodes), Some(q), Some(next)) =
            (self.nodes.get(start..start + avail), hashes.get(i - 1..i + avail), self.next.get(start..))
        else {
            return 0;
        };
        let base = self.nodes.as_ptr();
        let mut k = 0;
        while k + 4 <= avail {
            // a prefetch never faults: past the arena's end it is only wasted
            // four nodes a step: one line a step, RUN_AHEAD nodes ahead, covers every line
            crate::prefetch::prefetch_line(base.wrapping_add(start + k + RUN_AHEAD) as *const u8);
            // the hints are read two steps after their line was requested (read at once, a
            // short run, most of a fragmented prefix's, waited for the line)
            crate::prefetch::prefetch_line(next.as_ptr().wrapping_add(k + HINT_RUN_AHEAD + 8) as *const u8);
            let hints = if k >= 8 { next.get(k + HINT_RUN_AHEAD..k + HINT_RUN_AHEAD + 4) } else { None };
            if let Some(h) = hints {
                if h[0] & h[1] & h[2] & h[3] != NO_NEXT {
                    for &x in h {
                        if let Some(n) = self.nodes.get(x as usize) {
                            // the start of the run it names, a few lines of it
                            crate::prefetch::prefetch_bytes(n as *const Node as *const u8, 4 * 64);
                        }
                    }
                }
            }
            if let Some(n) = nodes.get(k + SET_AHEAD) {
                if n.set != set {
                    slab.prefetch(n.set);
                }
            }
            let mut ok = true;
            for d in 0..4 {
                let n = nodes[k + d];
                ok &= (n.key == q[k + d + 1]) & (n.tag == parent_tag(Some(q[k + d]))) & (n.set == set);
            }
            if !ok {
                break;
            }
            k += 4;
        }
        while k < avail {
            let n = nodes[k];
            if n.key != q[k + 1] || n.tag != parent_tag(Some(q[k])) || n.set != set {
                break;
            }
            k += 1;
        }
        k
    }

    /// The holder set word of the node at arena position `p` ([`EMPTY`] past the end).
    #[inline(always)]
    pub fn set_at(&self, p: usize) -> u32 {
        self.nodes.get(p).map_or(EMPTY, |n| n.set)
    }

    /// Start loading the holder bitset of the node at arena position `p`, if any.
    #[inline(always)]
    pub fn prefetch_set(&self, p: usize, slab: &Slab) {
        if let Some(n) = self.nodes.get(p) {
            slab.prefetch(n.set);
        }
    }

    /// The continuation hint of arena position `p` (a position, or past the arena's end).
    #[inline(always)]
    pub fn hint(&self, p: usize) -> usize {
        self.next.get(p).map_or(usize::MAX - 1, |&x| x as usize)
    }

    /// Start loading the node of `key` its home index slot names, if that slot is in cache
    /// by now (requested earlier with [`Self::prefetch`]) and holds `key`'s fingerprint.
    #[inline(always)]
    pub fn prefetch_node(&self, key: u64) {
        if !self.index.is_empty() {
            let f = fp(key);
            let s = self.index[Self::home_of(f, self.index.len())];
            if s != FREE_SLOT && (s >> 32) as u32 == f {
                self.prefetch_at(s as u32 as usize);
            }
        }
    }

    /// Start loading the node the hint of arena position `p` names, if any.
    #[inline(always)]
    pub fn prefetch_hint(&self, p: usize) {
        if let Some(&x) = self.next.get(p) {
            if let Some(n) = self.nodes.get(x as usize) {
                crate::prefetch::prefetch(n);
            }
        }
    }

    /// The node at arena position `a` was stored under the one at `q` (the block before it
    /// in a chain): remember where it went unless that is right after `q`.
    #[inline(always)]
    pub fn link(&mut self, q: usize, a: usize) {
        if a != q + 1 {
            if let Some(x) = self.next.get_mut(q) {
                *x = a as u32;
                if a >= self.young {
                    self.links += 1;
                    if q < self.young {
                        self.into_young.push(q as u32);
                    }
                }
            }
        }
    }

    /// The key of the live node at arena position `p`.
    #[inline(always)]
    pub fn key_at(&self, p: usize) -> Option<u64> {
        self.nodes.get(p).filter(|n| n.set != EMPTY).map(|n| n.key)
    }

    /// The arena position of a live node of `key` (under any tag).
    pub fn find_key(&self, key: u64) -> Option<usize> {
        if self.index.is_empty() {
            return None;
        }
        let f = fp(key);
        let mut i = Self::home_of(f, self.index.len());
        loop {
            let s = self.index[i];
            if s == FREE_SLOT {
                return None;
            }
            if (s >> 32) as u32 == f && self.nodes[s as u32 as usize].key == key {
                return Some(s as u32 as usize);
            }
            i = self.next(i);
        }
    }

    /// Start loading the home index slot of `key` (a hint: see [`crate::prefetch`]).
    #[inline(always)]
    pub fn prefetch(&self, key: u64) {
        if !self.index.is_empty() {
            crate::prefetch::prefetch(&self.index[Self::home_of(fp(key), self.index.len())]);
        }
    }

    /// Start loading the arena node at `p` (a hint).
    #[inline(always)]
    pub fn prefetch_at(&self, p: usize) {
        if let Some(n) = self.nodes.get(p) {
            crate::prefetch::prefetch(n);
        }
    }

    /// Delete index slot `i` by shifting back the slots of its run that may move closer to
    /// home.
    fn unindex(&mut self, mut i: usize) {
        let cap = self.index.len();
        let mut j = self.next(i);
        while self.index[j] != FREE_SLOT {
            let h = Self::home_of((self.index[j] >> 32) as u32, cap);
            // the slot at j may fill the hole at i if its home is not in (i, j]
            let dist_home = (j + cap - h) % cap;
            let dist_hole = (j + cap - i) % cap;
            if dist_home >= dist_hole {
                self.index[i] = self.index[j];
                self.slot_moved(self.index[j] as u32 as usize, i);
                i = j;
            }
            j = self.next(j);
        }
        self.index[i] = FREE_SLOT;
    }

    /// Delete the node that index slot `i` names.
    fn delete_slot(&mut self, i: usize) {
        let p = self.index[i] as u32 as usize;
        self.unindex(i);
        self.nodes[p].set = EMPTY;
        self.depth.put(p, 0);
        self.len -= 1;
        self.dead += 1;
        // dead nodes at the arena's end go at once (the next run is stored there)
        while self.nodes.last().is_some_and(|n| n.set == EMPTY) {
            self.nodes.pop();
            self.next.pop();
            self.dead -= 1;
        }
        self.young = self.young.min(self.nodes.len());
        self.young_slot.truncate(self.nodes.len() - self.young);
    }

    /// The index slot of arena position `p` (a live node).
    fn slot_of(&self, p: usize) -> usize {
        let f = fp(self.nodes[p].key);
        let mut i = Self::home_of(f, self.index.len());
        while self.index[i] != ((f as u64) << 32 | p as u64) {
            i = self.next(i);
        }
        i
    }

    /// [`Self::store`] of the live node at arena position `p` if it is `key` under `tag`
    /// (a chain's next block where the arena holds the chain: right after the block before
    /// it, or where that one's hint says), without probing the index: the change in
    /// (block, holder) pairs. None when it is not, or when some hash has nodes under two
    /// tags (a store must visit them all then).
    #[inline(always)]
    pub fn store_at(&mut self, p: usize, key: u64, tag: u32, inst: u32, depth: u8, slab: &mut Slab) -> Option<isize> {
        if self.dups {
            return None;
        }
        let n = self.nodes.get_mut(p)?;
        if n.key != key || n.tag != tag || n.set == EMPTY {
            return None;
        }
        Some(self.join(p, inst, depth, slab) as isize)
    }

    /// `inst` joins the holders of the live node at `p` (its depth kept with the pair count):
    /// true if it did not hold it.
    #[inline(always)]
    fn join(&mut self, p: usize, inst: u32, depth: u8, slab: &mut Slab) -> bool {
        let n = &mut self.nodes[p];
        let (set, added) = slab.insert(n.set, inst);
        n.set = set;
        if self.depth.on() {
            let pairs = slab.count(set);
            self.depth.restore(p, depth, pairs, added as usize);
        }
        added
    }

    /// `inst` holds `key` under `tag` (and under no other tag). Returns the change in the
    /// number of (block, holder) pairs: +1 if new, 0 if it already held it, and one less per
    /// other tag it is dropped from. `depth` is the block's chain depth (kept only while the
    /// index tracks depths; a node keeps the smallest depth it was stored at). A new node
    /// goes at the arena's end (after the block stored before it, in a run). Room must be
    /// reserved first ([`Table::reserve`], [`Slab::reserve`]). Also returns the node's arena
    /// position.
    pub fn store(&mut self, key: u64, tag: u32, inst: u32, depth: u8, slab: &mut Slab) -> (isize, usize) {
        let mut delta = 0isize;
        let mut found = false;
        let mut at = 0;
        let mut emptied = false;
        let mut other_kept = false;
        let f = fp(key);
        let mut i = Self::home_of(f, self.index.len());
        loop {
            let s = self.index[i];
            if s == FREE_SLOT {
                break;
            }
            if (s >> 32) as u32 == f {
                let p = s as u32 as usize;
                let n = &mut self.nodes[p];
                if n.key == key {
                    if n.tag == tag {
                        found = true;
                        at = p;
                        delta += self.join(p, inst, depth, slab) as isize;
                        if !self.dups {
                            // the only node of this hash
                            return (delta, p);
                        }
                    } else {
                        let (set, held) = slab.remove(n.set, inst);
                        delta -= held as isize;
                        self.depth.lose(p, held as usize);
                        match set {
                            Some(s) => {
                                n.set = s;
                                other_kept = true;
                            }
                            None => emptied = true,
                        }
                    }
                }
            }
            i = self.next(i);
        }
        if !found {
            // the free slot that ended the run (reserve guarantees one, and arena room)
            let p = self.nodes.len();
            at = p;
            self.nodes.push(Node { key, tag, set: inst });
            self.next.push(NO_NEXT);
            self.index[i] = (f as u64) << 32 | p as u64;
            if self.young_slot.len() == p - self.young && self.young_slot.len() < self.young_slot.capacity() {
                self.young_slot.push(u32::try_from(i).unwrap_or(NO_SLOT));
            }
            self.depth.put(p, depth);
            self.depth.gain(p, 1);
            self.len += 1;
            delta += 1;
            if other_kept {
                self.dups = true;
            }
        }
        if emptied {
            self.drop_emptied(key, inst, Some(tag));
        }
        (delta, at)
    }

    /// Delete the nodes of `key` (other than the one tagged `keep`) whose last holder
    /// `inst` was just removed (their set word still names it).
    fn drop_emptied(&mut self, key: u64, inst: u32, keep: Option<u32>) {
        let f = fp(key);
        loop {
            let mut i = Self::home_of(f, self.index.len());
            let mut hit = None;
            while self.index[i] != FREE_SLOT {
                let s = self.index[i];
                if (s >> 32) as u32 == f {
                    let n = self.nodes[s as u32 as usize];
                    if n.key == key && n.set == inst && Some(n.tag) != keep {
                        hit = Some(i);
                        break;
                    }
                }
                i = self.next(i);
            }
            match hit {
                Some(i) => self.delete_slot(i),
                None => return,
            }
        }
    }

    /// `inst` no longer holds `key` (under any tag). Returns the pairs removed.
    pub fn remove(&mut self, key: u64, inst: u32, slab: &mut Slab) -> usize {
        if self.index.is_empty() {
            return 0;
        }
        let mut removed = 0;
        let mut emptied = false;
        let f = fp(key);
        let mut i = Self::home_of(f, self.index.len());
        loop {
            let s = self.index[i];
            if s == FREE_SLOT {
                break;
            }
            if (s >> 32) as u32 == f {
                let p = s as u32 as usize;
                let n = &mut self.nodes[p];
                if n.key == key {
                    let (set, held) = slab.remove(n.set, inst);
                    removed += held as usize;
                    self.depth.lose(p, held as usize);
                    match set {
                        Some(s) => n.set = s,
                        None => {
                            if !self.dups {
                                // the only node of this hash
                                self.delete_slot(i);
                                return removed;
                            }
                            emptied = true
                        }
                    }
                    if !self.dups {
                        return removed;
                    }
                }
            }
            i = self.next(i);
        }
        if emptied {
            self.drop_emptied(key, inst, None);
        }
        removed
    }

    /// The eviction clock: from the hand on (arena order), delete whole nodes (every holder
    /// of the block) until `want` pairs are dropped or the hand has gone once round; nodes
    /// held by more than one instance are skipped unless `shared`. `on_drop(key, set, slab)`
    /// sees each deleted node before its holder set is released. Deleting only ever makes
    /// the index under-report (a lookup stops at the missing block), never over-report.
    pub fn evict(
        &mut self,
        want: usize,
        shared: bool,
        slab: &mut Slab,
        mut on_drop: impl FnMut(u64, u32, &Slab),
    ) -> Swept {
        let mut out = Swept::default();
        if self.nodes.is_empty() || self.len == 0 {
            out.exhausted = true;
            return out;
        }
        let total = self.nodes.len();
        let mut i = self.hand % total;
        let mut seen = 0;
        while out.pairs < want {
            if seen >= total || self.len == 0 {
                out.exhausted = true;
                break;
            }
            if i >= self.nodes.len() {
                // the arena's dead tail went
                i = 0;
            }
            let n = self.nodes[i];
            if n.set != EMPTY && (shared || n.set & super::holders::MULTI == 0) {
                out.pairs += slab.count(n.set);
                out.nodes += 1;
                on_drop(n.key, n.set, slab);
                slab.drop_set(n.set);
                let s = self.slot_of(i);
                self.delete_slot(s);
            }
            i += 1;
            seen += 1;
        }
        self.hand = i;
        out
    }

    /// Keep chain depths (`depths`: a depth per arena position, from [`Self::slot_nodes`]'
    /// order) or stop (None). Fails only for memory, tracking nothing then.
    pub fn track_depths(&mut self, depths: Option<Vec<u8>>, slab: &Slab) -> Result<()> {
        let Some(d) = depths else { return self.depth.track(None) };
        if let Err(e) = self.depth.track(Some(self.nodes.capacity().max(self.nodes.len()))) {
            self.depth.track(None)?;
            return Err(e);
        }
        for (i, x) in d.into_iter().enumerate().take(self.nodes.len()) {
            if self.nodes[i].set != EMPTY {
                self.depth.put(i, x);
            }
        }
        let nodes = &self.nodes;
        self.depth.recount(|i| nodes.get(i).filter(|n| n.set != EMPTY).map(|n| slab.count(n.set)));
        Ok(())
    }

    /// Tracking chain depths?
    pub fn tracks_depths(&self) -> bool {
        self.depth.on()
    }

    /// Every arena node (None: dead), in arena order.
    pub fn slot_nodes(&self) -> impl Iterator<Item = Option<&Node>> {
        self.nodes.iter().map(|n| (n.set != EMPTY).then_some(n))
    }

    /// The smallest depth of a node of `key` (under any parent), if the table has one and
    /// tracks depths.
    pub fn depth_of(&self, key: u64) -> Option<u8> {
        if !self.depth.on() || self.index.is_empty() {
            return None;
        }
        let mut best = None;
        let f = fp(key);
        let mut i = Self::home_of(f, self.index.len());
        while self.index[i] != FREE_SLOT {
            let s = self.index[i];
            if (s >> 32) as u32 == f {
                let p = s as u32 as usize;
                if self.nodes[p].key == key {
                    let d = self.depth.at(p);
                    best = Some(best.map_or(d, |b: u8| b.min(d)));
                    if !self.dups {
                        break;
                    }
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
        let mut out = Swept::default();
        let mut deeper: usize = (cut as usize + 1..256).map(|d| self.depth.pairs_at(d as u8)).sum();
        if self.nodes.is_empty() || self.len == 0 || !self.depth.on() {
            out.exhausted = true;
            return out;
        }
        let total = self.nodes.len();
        let mut i = self.hand % total;
        let mut seen = 0;
        while deeper > 0 || (*budget > 0 && self.depth.pairs_at(cut) > 0) {
            if seen >= total || self.len == 0 {
                out.exhausted = true;
                break;
            }
            if i >= self.nodes.len() {
                i = 0;
            }
            let d = self.depth.at(i);
            // dead nodes are depth 0, never at or past a cut (>= 2)
            if d > cut || (d == cut && *budget > 0) {
                let n = self.nodes[i];
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
                let s = self.slot_of(i);
                self.delete_slot(s);
            }
            i += 1;
            seen += 1;
        }
        self.hand = i;
        out
    }

    /// Drop `inst` from every block. Returns the pairs removed.
    pub fn clear_instance(&mut self, inst: u32, slab: &mut Slab) -> usize {
        let mut removed = 0;
        let mut kept = 0;
        for (i, n) in self.nodes.iter_mut().enumerate().filter(|(_, n)| n.set != EMPTY) {
            let (set, held) = slab.remove(n.set, inst);
            removed += held as usize;
            self.depth.lose(i, held as usize);
            match set {
                Some(s) => {
                    n.set = s;
                    kept += 1;
                }
                None => {
                    n.set = EMPTY;
                    self.depth.put(i, 0);
                }
            }
        }
        if removed > 0 {
            // compact the arena and re-index (into a smaller index if due)
            self.dead += self.len - kept;
            self.len = kept;
            self.compact();
            let cap = self.index.len();
            if kept < cap / 4 {
                let _ = self.reindex(kept * 5 / 3 + 1);
            }
        }
        removed
    }

    /// Every (hash, parent tag) `inst` holds.
    pub fn blocks_of(&self, inst: u32, slab: &Slab) -> Vec<(u64, u32)> {
        self.iter().filter(|n| slab.contains(n.set, inst)).map(|n| (n.key, n.tag)).collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.set != EMPTY)
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
        let load = t.len() as f64 / t.index.len() as f64;
        assert!(load <= 0.8 + 1e-9, "load {load}");
        assert_eq!(t.clear_instance(0, &mut slab), live.len());
        assert!(t.is_empty() && t.get(1, 5).is_none());
    }

    /// `store_at` adds a holder to the node at a position only when that node is live and
    /// is the key under the tag (the pairs added as `store` counts them); otherwise, or once
    /// a hash has nodes under two tags, it is None and changes nothing.
    #[test]
    fn store_at_takes_only_the_live_node_it_names() {
        let mut t = Table::default();
        let mut slab = Slab::new();
        t.reserve(8).unwrap();
        let tag = parent_tag(Some(10));
        let (_, a) = t.store(10, 7, 0, 2, &mut slab);
        let (_, b) = t.store(11, tag, 0, 3, &mut slab);
        assert_eq!(b, a + 1);
        assert_eq!(t.store_at(b, 11, tag, 1, 3, &mut slab), Some(1));
        assert_eq!(t.store_at(b, 11, tag, 1, 3, &mut slab), Some(0));
        let set = t.get(11, tag).unwrap();
        assert!(slab.contains(set, 0) && slab.contains(set, 1));
        for (p, key, tg) in [(b, 12, tag), (b, 11, 5), (b + 1, 11, tag), (usize::MAX, 11, tag)] {
            assert_eq!(t.store_at(p, key, tg, 2, 3, &mut slab), None);
        }
        assert_eq!(t.get(11, tag), Some(set));
        // a dead node is not taken
        t.remove(10, 0, &mut slab);
        assert_eq!(t.store_at(a, 10, 7, 2, 2, &mut slab), None);
        assert_eq!(t.get(10, 7), None);
        // a hash under two tags: a store must visit every node of it
        t.store(11, 9, 2, 3, &mut slab);
        assert_eq!(t.store_at(b, 11, tag, 3, 3, &mut slab), None);
        assert_eq!(t.len(), 2);
    }

    /// A table that does not settle, its slab, forty chains of 64 blocks (chain `c`'s blocks
    /// `c << 32 | 1..=64`) none of them stored yet, and each chain's last stored node (none).
    #[allow(clippy::type_complexity)]
    fn forty_chains_unstored() -> (Table, Slab, Vec<Vec<u64>>, Vec<Option<usize>>) {
        let t = Table { no_settle: true, ..Table::default() };
        let chains: Vec<Vec<u64>> = (0..40u64).map(|c| (0..64).map(|b| (c << 32) | (b + 1)).collect()).collect();
        let prev = vec![None; chains.len()];
        (t, Slab::new(), chains, prev)
    }

    /// Block `i`'s tag in chain `ch`: 7 for the first, its parent's tag after.
    fn tag_of(ch: &[u64], i: usize) -> u32 {
        if i == 0 {
            7
        } else {
            parent_tag(Some(ch[i - 1]))
        }
    }

    /// Store batch `batch` (blocks `8 * batch..8 * batch + 8`) of chain `c`, each block
    /// linked after the chain's previous one (`prev[c]`), held by instance `c % 3`.
    fn store_batch(
        t: &mut Table,
        slab: &mut Slab,
        chains: &[Vec<u64>],
        c: usize,
        batch: usize,
        prev: &mut [Option<usize>],
    ) {
        let ch = &chains[c];
        for i in batch * 8..batch * 8 + 8 {
            let (_, at) = t.store(ch[i], tag_of(ch, i), c as u32 % 3, 2, slab);
            if let Some(q) = prev[c] {
                t.link(q, at);
            }
            prev[c] = Some(at);
        }
    }

    /// Chains stored in batches of 8, each under the previous batch's last block, the
    /// chains' batches interleaved (as engines' streams arrive): the runs are linked by
    /// their hints, and the arena's growth lays every chain out contiguously.
    #[test]
    fn growth_lays_chains_out_contiguously() {
        let (mut t, mut slab, chains, mut prev) = forty_chains_unstored();
        // room for all: no growth until asked for below
        t.reserve(40 * 64).unwrap();
        for batch in 0..8 {
            for c in 0..chains.len() {
                t.reserve(8).unwrap();
                store_batch(&mut t, &mut slab, &chains, c, batch, &mut prev);
            }
        }
        // before: a chain's next batch is where its last block's hint says
        let ch = &chains[5];
        let end = t.find(ch[7], tag_of(ch, 7)).unwrap();
        assert_eq!(t.at(end + 1, ch[8], tag_of(ch, 8)), EMPTY);
        assert_ne!(t.at(t.hint(end), ch[8], tag_of(ch, 8)), EMPTY);
        t.reserve(t.nodes.capacity()).unwrap();
        for ch in &chains {
            let p0 = t.find(ch[0], 7).unwrap();
            for i in 0..ch.len() {
                assert_eq!(t.at(p0 + i, ch[i], tag_of(ch, i)), t.get(ch[i], tag_of(ch, i)).unwrap());
            }
        }
        assert_eq!(t.len(), 40 * 64);
    }

    /// The young nodes settle in place: chains whose first batch was laid out before and
    /// whose later batches came interleaved with other chains' read contiguously after their
    /// first batch's hint, every index slot names its node's new position, and the dead
    /// young nodes go.
    #[test]
    fn settling_lays_young_chains_out_in_place() {
        let (mut t, mut slab, chains, mut prev) = forty_chains_unstored();
        t.reserve(40 * 64 + 40).unwrap();
        let cap = t.nodes.capacity();
        for batch in 0..8 {
            if batch == 1 {
                // the first batches were laid out
                t.laid_out();
            }
            for c in 0..chains.len() {
                if batch == 3 {
                    // a dead young node: a block stored, then removed once others follow
                    t.store(1 << 60 | c as u64, 9, 1, 2, &mut slab);
                }
                store_batch(&mut t, &mut slab, &chains, c, batch, &mut prev);
                if batch == 3 {
                    t.remove(1 << 60 | c as u64, 1, &mut slab);
                }
            }
        }
        assert!(t.dead > 0);
        t.settle();
        assert_eq!((t.dead, t.len(), t.nodes.len(), t.nodes.capacity()), (0, 40 * 64, 40 * 64, cap));
        for (c, ch) in chains.iter().enumerate() {
            let p0 = t.find(ch[0], 7).unwrap();
            assert!(p0 < 40 * 8, "chain {c}'s first batch stays");
            let q0 = t.hint(p0 + 7);
            for i in 0..ch.len() {
                let p = if i < 8 { p0 + i } else { q0 + i - 8 };
                assert_eq!(t.at(p, ch[i], tag_of(ch, i)), c as u32 % 3, "chain {c}, block {i}");
                assert_eq!(t.find(ch[i], tag_of(ch, i)), Some(p));
            }
        }
    }

    /// A table's moves, composed when two come before they are asked for, carry another
    /// table's hints into it over: each still names its node.
    #[test]
    fn foreign_hints_follow_the_moves() {
        let mut t = Table { record_moves: true, no_settle: true, ..Table::default() };
        let mut roots = Table { foreign_hints: true, ..Table::default() };
        let mut slab = Slab::new();
        t.reserve(64).unwrap();
        roots.reserve(8).unwrap();
        // 8 chains of 8, stored a batch of 2 at a time, interleaved; each chain's first
        // block a root whose hint names the chain's second block
        let key = |c: u64, b: u64| (c + 1) << 32 | (b + 1);
        let tag = |c: u64, b: u64| if b == 0 { ROOT_TAG } else { parent_tag(Some(key(c, b - 1))) };
        let mut prev: Vec<Option<usize>> = vec![None; 8];
        for batch in 0..4 {
            for c in 0..8u64 {
                for b in batch * 2..batch * 2 + 2 {
                    if b == 0 {
                        let (_, rp) = roots.store(key(c, 0), ROOT_TAG, c as u32, 1, &mut slab);
                        assert_eq!(rp, c as usize);
                        continue;
                    }
                    let (_, at) = t.store(key(c, b), tag(c, b), c as u32, 2, &mut slab);
                    if b == 1 {
                        roots.set_hint(c as usize, at);
                    }
                    if let Some(q) = prev[c as usize] {
                        t.link(q, at);
                    }
                    prev[c as usize] = Some(at);
                }
            }
        }
        // chain 3 goes but its second block, chain 5 loses a block: dead nodes; then a
        // compaction and a settle (every node young) before the moves are asked for
        for b in 2..8 {
            t.remove(key(3, b), 3, &mut slab);
        }
        t.remove(key(5, 4), 5, &mut slab);
        t.compact();
        t.settle();
        let moves = t.take_moves();
        assert!(matches!(moves, Moves::Map(0, _)));
        assert!(matches!(t.take_moves(), Moves::None));
        roots.remap_hints(&moves);
        for c in 0..8u64 {
            assert_eq!(t.at(roots.hint(c as usize), key(c, 1), tag(c, 1)), c as u32, "chain {c}");
        }
        // the chains now read contiguously from their second block
        for c in (0..8u64).filter(|c| ![3, 5].contains(c)) {
            let p = roots.hint(c as usize);
            for b in 1..8 {
                assert_eq!(t.at(p + b as usize - 1, key(c, b), tag(c, b)), c as u32, "chain {c}, block {b}");
            }
        }
        roots.remap_hints(&Moves::Lost);
        assert!((0..8).all(|c| roots.hint(c) == NO_NEXT as usize));
    }

    /// Compaction (an arena left more than half dead) keeps every chain followable without
    /// a probe: each block is right after the one before it or where that one's hint says.
    #[test]
    fn compaction_carries_the_hints_over() {
        let mut t = Table::default();
        let mut slab = Slab::new();
        let chains: Vec<Vec<u64>> = (0..6u64).map(|c| (0..64).map(|b| (c << 32) | (b + 1)).collect()).collect();
        let tag_of = |ch: &[u64], i: usize| if i == 0 { 7 } else { parent_tag(Some(ch[i - 1])) };
        let mut prev: Vec<Option<usize>> = vec![None; chains.len()];
        t.reserve(6 * 64).unwrap();
        for batch in 0..8 {
            for (c, ch) in chains.iter().enumerate() {
                for i in batch * 8..batch * 8 + 8 {
                    let (_, at) = t.store(ch[i], tag_of(ch, i), c as u32, 2, &mut slab);
                    if let Some(q) = prev[c] {
                        t.link(q, at);
                    }
                    prev[c] = Some(at);
                }
            }
        }
        // chains 1.. go, but for the last one's first half
        for (c, ch) in chains.iter().enumerate().skip(1) {
            let keep = if c == 5 { 32 } else { 0 };
            for &h in &ch[keep..] {
                t.remove(h, c as u32, &mut slab);
            }
        }
        assert!(t.dead > t.len && t.dead > 64);
        t.maybe_shrink();
        assert_eq!((t.dead, t.len(), t.nodes.len()), (0, 64 + 32, 64 + 32));
        for (c, ch) in chains.iter().enumerate().filter(|(c, _)| [0, 5].contains(c)) {
            let n = if c == 5 { 32 } else { 64 };
            let mut p = t.find(ch[0], 7).unwrap();
            for i in 1..n {
                let (h, tag) = (ch[i], tag_of(ch, i));
                p = if t.at(p + 1, h, tag) != EMPTY { p + 1 } else { t.hint(p) };
                assert_eq!(t.at(p, h, tag), c as u32, "chain {c}, block {i}");
            }
            assert_eq!(t.get(ch[n - 1], tag_of(ch, n - 1)), Some(c as u32));
        }
    }
}
