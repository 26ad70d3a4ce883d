//! Chain depths of a table's nodes, for the memory cap's eviction order (PyO3-free).
//!
//! A block's depth is its position in its chain: a chain's first block is 1 (those live in the
//! roots table, which keeps no depths), its next block 2, and so on, saturating at
//! [`DEEP`]: blocks deeper than 254 and blocks whose parent the index does not hold (an
//! orphan: unreachable by any lookup until the parent comes back) share the last value and
//! are evicted first. vLLM's block hash covers the whole prefix, so a (hash, parent) node has
//! one depth whoever holds it.
//!
//! Kept only while the index is capped: one byte per arena position of a table, parallel to
//! its nodes (0 for a dead one), and the number of (block, holder) pairs at each depth, from which the
//! cap finds in O(256) the depth it must cut at. Off (no allocation, every call a no-op
//! after one branch) in an uncapped index.

use crate::error::{Error, Result};

/// The depth of blocks 255 or more deep, and of orphans.
pub const DEEP: u8 = u8::MAX;

#[derive(Debug, Default)]
pub struct Depths {
    /// Per slot (empty: not tracking).
    d: Vec<u8>,
    /// (block, holder) pairs per depth (256 entries while tracking).
    hist: Vec<usize>,
}

impl Depths {
    /// Tracking depths?
    #[inline(always)]
    pub fn on(&self) -> bool {
        !self.hist.is_empty()
    }

    /// Start tracking over `slots` slots, every depth 0 (the caller fills them in with
    /// [`Self::set`]); or stop (`slots` None) and free the memory.
    pub fn track(&mut self, slots: Option<usize>) -> Result<()> {
        match slots {
            None => *self = Depths::default(),
            Some(n) => {
                let mut d = Vec::new();
                d.try_reserve_exact(n).map_err(|_| Error::Memory("cannot grow the prefix index".into()))?;
                d.resize(n, 0);
                *self = Depths { d, hist: vec![0; 256] };
            }
        }
        Ok(())
    }

    pub fn allocation_size(&self) -> usize {
        self.d.capacity() + self.hist.capacity() * std::mem::size_of::<usize>()
    }

    /// For a table rebuilt with `cap` slots: a fresh zeroed array in place, the old one
    /// returned (empty when not tracking). The histogram is unchanged (the same nodes).
    pub fn resized(&mut self, cap: usize) -> Result<Vec<u8>> {
        if !self.on() {
            return Ok(Vec::new());
        }
        let mut d = Vec::new();
        d.try_reserve_exact(cap).map_err(|_| Error::Memory("cannot grow the prefix index".into()))?;
        d.resize(cap, 0);
        Ok(std::mem::replace(&mut self.d, d))
    }

    /// Room for slots `0..n` (new ones at depth 0) while tracking; fails only for memory.
    pub fn ensure(&mut self, n: usize) -> Result<()> {
        if self.on() && self.d.len() < n {
            let extra = n - self.d.len();
            self.d.try_reserve(extra).map_err(|_| Error::Memory("cannot grow the prefix index".into()))?;
            self.d.resize(n, 0);
        }
        Ok(())
    }

    /// The depth at slot `i` (0 when not tracking).
    #[inline(always)]
    pub fn at(&self, i: usize) -> u8 {
        self.d.get(i).copied().unwrap_or(0)
    }

    /// Slot `i` now holds a node at depth `d` (0: none); the histogram is the caller's.
    #[inline(always)]
    pub fn put(&mut self, i: usize, d: u8) {
        if let Some(x) = self.d.get_mut(i) {
            *x = d;
        }
    }

    /// The node at slot `from` moved to slot `to`.
    #[inline(always)]
    pub fn shift(&mut self, from: usize, to: usize) {
        if self.on() {
            self.d[to] = self.d[from];
        }
    }

    /// The node at slot `i` gained `pairs` holders.
    #[inline(always)]
    pub fn gain(&mut self, i: usize, pairs: usize) {
        if self.on() {
            self.hist[self.d[i] as usize] += pairs;
        }
    }

    /// The node at slot `i` lost `pairs` holders.
    #[inline(always)]
    pub fn lose(&mut self, i: usize, pairs: usize) {
        if self.on() {
            let h = &mut self.hist[self.d[i] as usize];
            *h = h.saturating_sub(pairs);
        }
    }

    /// The node at slot `i` (with `pairs` holders now, `added` of them new) was stored again
    /// at depth `d`: it keeps the smaller depth.
    pub fn restore(&mut self, i: usize, d: u8, pairs: usize, added: usize) {
        self.gain(i, added);
        self.set(i, d.min(self.d[i]), pairs);
    }

    /// Set the depth of the node at slot `i`, with `pairs` holders, to `d`.
    pub fn set(&mut self, i: usize, d: u8, pairs: usize) {
        if !self.on() || self.d[i] == d {
            return;
        }
        let old = &mut self.hist[self.d[i] as usize];
        *old = old.saturating_sub(pairs);
        self.hist[d as usize] += pairs;
        self.d[i] = d;
    }

    /// Recount the histogram: `pairs(i)` holders at each occupied slot `i`.
    pub fn recount(&mut self, mut pairs: impl FnMut(usize) -> Option<usize>) {
        if !self.on() {
            return;
        }
        self.hist.fill(0);
        for i in 0..self.d.len() {
            if let Some(p) = pairs(i) {
                self.hist[self.d[i] as usize] += p;
            }
        }
    }

    /// Pairs at depth `d`.
    #[inline(always)]
    pub fn pairs_at(&self, d: u8) -> usize {
        self.hist.get(d as usize).copied().unwrap_or(0)
    }

    /// The per-slot depths (empty when not tracking).
    #[inline(always)]
    pub fn slots(&self) -> &[u8] {
        &self.d
    }
}
