//! KV-cache residency metrics: vLLM's `KVCacheMetricsCollector` (`--kv-cache-metrics`) as state
//! of the block pool, fed by the pool's own transitions instead of per-block Python calls.
//!
//! vLLM (0.32–0.34, `vllm/v1/core/kv_cache_metrics.py`) samples a block when it is handed out
//! (`on_block_allocated`, a fresh state with probability `sample_rate`), records an access
//! when a hit touches it (`on_block_accessed`: last access and a history bounded to the last
//! 4 accesses) and, when a sampled block is evicted (`on_block_evicted`), drops its state and
//! records one eviction event: lifetime (now − birth), idle time (now − last access) and the
//! gaps between the recorded accesses. `reset()` forgets every sampled block and every event.
//! The sampled blocks are kept in vLLM's dict order (insertion order; re-sampling a block that
//! is still sampled keeps its place).
//!
//! Times are nanoseconds on the caller's clock ([`now_ns`]: `CLOCK_MONOTONIC`, the clock of
//! Python's `time.monotonic_ns`); every method takes `now` so the state machine is
//! deterministic. Sampling draws from a SplitMix64 generator: a block is sampled iff
//! `u < sample_rate` with `u` uniform in `[0, 1)` on a 2⁻⁵³ grid, as Python's
//! `random.random() < sample_rate` (so a rate ≥ 1 samples every block, a rate ≤ 0 or NaN none).

use crate::error::{Error, Result};
use crate::pool::link::{Link, NO_LINK};

/// Accesses kept per sampled block (vLLM's `deque(maxlen=4)`).
pub const HISTORY: usize = 4;

/// The clock of Python's `time.monotonic_ns()` in nanoseconds: `CLOCK_MONOTONIC` (macOS:
/// `CLOCK_UPTIME_RAW`, the clock of `mach_absolute_time`, which CPython reads there).
pub fn now_ns() -> u64 {
    #[cfg(target_os = "macos")]
    const CLOCK: libc::clockid_t = libc::CLOCK_UPTIME_RAW;
    #[cfg(not(target_os = "macos"))]
    const CLOCK: libc::clockid_t = libc::CLOCK_MONOTONIC;
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the OS provides.
    let rc = unsafe { libc::clock_gettime(CLOCK, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// One sampled block (vLLM's `BlockMetricsState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// `birth_time_ns`.
    pub birth_ns: u64,
    /// `last_access_ns`.
    pub last_access_ns: u64,
    /// `access_history`, oldest first (the first `len` entries).
    history: [u64; HISTORY],
    len: u8,
}

impl Sample {
    /// A state born at `now` (no access recorded).
    pub fn new(now: u64) -> Sample {
        Sample { birth_ns: now, last_access_ns: now, history: [0; HISTORY], len: 0 }
    }

    /// A state with these fields; of `history`, the last [`HISTORY`] entries are kept.
    pub fn with(birth_ns: u64, last_access_ns: u64, history: &[u64]) -> Sample {
        let mut s = Sample { birth_ns, last_access_ns, history: [0; HISTORY], len: 0 };
        for &t in &history[history.len().saturating_sub(HISTORY)..] {
            s.push(t);
        }
        s
    }

    fn push(&mut self, t: u64) {
        if (self.len as usize) < HISTORY {
            self.history[self.len as usize] = t;
            self.len += 1;
        } else {
            self.history.copy_within(1.., 0);
            self.history[HISTORY - 1] = t;
        }
    }

    /// `record_access()`.
    fn record_access(&mut self, now: u64) {
        self.last_access_ns = now;
        self.push(now);
    }

    /// `access_history`, oldest first.
    pub fn history(&self) -> &[u64] {
        &self.history[..self.len as usize]
    }
}

/// One eviction of a sampled block (vLLM's `KVCacheEvictionEvent`, in nanoseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionEvent {
    /// now − birth.
    pub lifetime_ns: u64,
    /// now − last access.
    pub idle_ns: u64,
    gaps: [u64; HISTORY - 1],
    num_gaps: u8,
}

impl EvictionEvent {
    /// The gaps between consecutive recorded accesses (none with fewer than two accesses).
    pub fn reuse_gaps_ns(&self) -> &[u64] {
        &self.gaps[..self.num_gaps as usize]
    }
}

/// The residency metrics of one pool.
#[derive(Clone, Debug)]
pub struct Residency {
    sample_rate: f64,
    rng: u64,
    samples: Vec<Sample>,
    /// The sampled blocks in insertion order (vLLM's dict order); `sampled[b]` says whether
    /// block `b` is linked.
    order: Vec<Link>,
    sampled: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
    events: Vec<EvictionEvent>,
}

impl Residency {
    /// Metrics for a pool of `num_blocks` blocks, sampling at `sample_rate` (any value: see the
    /// module docs) from the generator seeded with `seed`.
    pub fn new(num_blocks: usize, sample_rate: f64, seed: u64) -> Result<Residency> {
        Ok(Residency {
            sample_rate,
            rng: seed,
            samples: Error::try_vec("the residency metrics", num_blocks, Sample::new(0))?,
            order: Error::try_vec("the residency metrics", num_blocks, Link::NONE)?,
            sampled: Error::try_vec("the residency metrics", num_blocks, false)?,
            head: NO_LINK,
            tail: NO_LINK,
            len: 0,
            events: Vec::new(),
        })
    }

    /// The number of blocks of the pool these metrics were made for.
    pub fn num_blocks(&self) -> usize {
        self.samples.len()
    }

    /// `sample_rate`.
    pub fn sample_rate(&self) -> f64 {
        self.sample_rate
    }

    /// Change `sample_rate` (vLLM reads the attribute at every allocation).
    pub fn set_sample_rate(&mut self, rate: f64) {
        self.sample_rate = rate;
    }

    /// `should_sample_block()`: a SplitMix64 draw `u` in `[0, 1)`, true iff `u < sample_rate`.
    #[inline]
    fn should_sample(&mut self) -> bool {
        if self.sample_rate >= 1.0 {
            return true;
        }
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64) * (1.0 / (1u64 << 53) as f64) < self.sample_rate
    }

    fn link_tail(&mut self, b: u32) {
        self.order[b as usize] = Link { prev: self.tail, next: NO_LINK };
        if self.tail == NO_LINK {
            self.head = b;
        } else {
            self.order[self.tail as usize].next = b;
        }
        self.tail = b;
        self.sampled[b as usize] = true;
        self.len += 1;
    }

    fn unlink(&mut self, b: u32) {
        let Link { prev, next } = self.order[b as usize];
        if prev == NO_LINK {
            self.head = next;
        } else {
            self.order[prev as usize].next = next;
        }
        if next == NO_LINK {
            self.tail = prev;
        } else {
            self.order[next as usize].prev = prev;
        }
        self.order[b as usize] = Link::NONE;
        self.sampled[b as usize] = false;
        self.len -= 1;
    }

    /// True if block `b` is sampled.
    #[inline(always)]
    pub fn is_sampled(&self, b: u32) -> bool {
        self.sampled[b as usize]
    }

    /// `on_block_allocated(block)`: with probability `sample_rate`, a fresh state for `b`
    /// (replacing one it has, in place).
    #[inline]
    pub fn on_allocated(&mut self, b: u32, now: u64) {
        if self.should_sample() {
            self.set(b, Sample::new(now));
        }
    }

    /// `on_block_accessed(block)`: record an access of a sampled block.
    #[inline]
    pub fn on_accessed(&mut self, b: u32, now: u64) {
        if self.sampled[b as usize] {
            self.samples[b as usize].record_access(now);
        }
    }

    /// `on_block_evicted(block)`: a sampled block's state is dropped and its eviction recorded.
    #[inline]
    pub fn on_evicted(&mut self, b: u32, now: u64) {
        if !self.sampled[b as usize] {
            return;
        }
        self.unlink(b);
        let s = self.samples[b as usize];
        let h = s.history();
        let mut gaps = [0u64; HISTORY - 1];
        let num_gaps = h.len().saturating_sub(1);
        for i in 1..h.len() {
            gaps[i - 1] = h[i].wrapping_sub(h[i - 1]);
        }
        self.events.push(EvictionEvent {
            lifetime_ns: now.wrapping_sub(s.birth_ns),
            idle_ns: now.wrapping_sub(s.last_access_ns),
            gaps,
            num_gaps: num_gaps as u8,
        });
    }

    /// `block_metrics[b] = state`: set (or replace, in place) block `b`'s state.
    pub fn set(&mut self, b: u32, s: Sample) {
        if !self.sampled[b as usize] {
            self.link_tail(b);
        }
        self.samples[b as usize] = s;
    }

    /// `block_metrics.get(b)`.
    pub fn get(&self, b: u32) -> Option<&Sample> {
        self.sampled[b as usize].then(|| &self.samples[b as usize])
    }

    /// `del block_metrics[b]`: forget `b`'s state without an event; false if it had none.
    pub fn remove(&mut self, b: u32) -> bool {
        if !self.sampled[b as usize] {
            return false;
        }
        self.unlink(b);
        true
    }

    /// `block_metrics.clear()`.
    pub fn clear_samples(&mut self) {
        let mut b = self.head;
        while b != NO_LINK {
            let next = self.order[b as usize].next;
            self.order[b as usize] = Link::NONE;
            self.sampled[b as usize] = false;
            b = next;
        }
        self.head = NO_LINK;
        self.tail = NO_LINK;
        self.len = 0;
    }

    /// `reset()`: no sampled block, no pending event.
    pub fn reset(&mut self) {
        self.clear_samples();
        self.events.clear();
    }

    /// Number of sampled blocks.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if no block is sampled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sampled blocks in vLLM's dict order.
    pub fn sampled_ids(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        let mut b = self.head;
        while b != NO_LINK {
            out.push(b);
            b = self.order[b as usize].next;
        }
        out
    }

    /// The eviction events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<EvictionEvent> {
        std::mem::take(&mut self.events)
    }

    /// Number of eviction events not taken yet.
    pub fn num_pending_events(&self) -> usize {
        self.events.len()
    }

    /// Check that block `b` is one of `num_blocks` blocks.
    pub fn check_id(&self, b: u32) -> Result<()> {
        if (b as usize) < self.sampled.len() {
            Ok(())
        } else {
            Err(Error::value("block_id", format!("{b} is out of range [0, {})", self.sampled.len())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_as_vllm_records_it() {
        let mut r = Residency::new(8, 1.0, 0).unwrap();
        r.on_allocated(3, 100);
        r.on_allocated(5, 110);
        assert_eq!(r.sampled_ids(), vec![3, 5]);
        for t in [200, 300, 450, 460, 700] {
            r.on_accessed(3, t);
        }
        let s = *r.get(3).unwrap();
        assert_eq!((s.birth_ns, s.last_access_ns), (100, 700));
        assert_eq!(s.history(), &[300, 450, 460, 700]); // bounded to the last 4
        r.on_evicted(3, 1000);
        r.on_evicted(4, 1000); // never sampled: nothing
        let ev = r.take_events();
        assert_eq!(ev.len(), 1);
        assert_eq!((ev[0].lifetime_ns, ev[0].idle_ns), (900, 300));
        assert_eq!(ev[0].reuse_gaps_ns(), &[150, 10, 240]);
        assert_eq!(r.sampled_ids(), vec![5]);
        // one access: no gap; none: no gap
        r.on_accessed(5, 120);
        r.on_evicted(5, 130);
        assert_eq!(r.take_events()[0].reuse_gaps_ns(), &[] as &[u64]);
        assert!(r.is_empty());
    }

    #[test]
    fn resampling_keeps_the_dict_position_and_restarts_the_state() {
        let mut r = Residency::new(8, 1.0, 0).unwrap();
        for b in [1, 2, 3] {
            r.on_allocated(b, 10);
        }
        r.on_accessed(1, 20);
        r.on_allocated(1, 30);
        assert_eq!(r.sampled_ids(), vec![1, 2, 3]);
        assert_eq!(*r.get(1).unwrap(), Sample::new(30));
        r.on_evicted(2, 40);
        r.on_allocated(2, 50);
        assert_eq!(r.sampled_ids(), vec![1, 3, 2]);
        r.reset();
        assert!(r.is_empty() && r.num_pending_events() == 0 && r.get(1).is_none());
    }

    #[test]
    fn rates_outside_the_unit_interval_behave_as_pythons_comparison() {
        let mut all = Residency::new(64, 1.5, 7).unwrap();
        let mut none = Residency::new(64, 0.0, 7).unwrap();
        let mut nan = Residency::new(64, f64::NAN, 7).unwrap();
        for b in 0..64 {
            all.on_allocated(b, 1);
            none.on_allocated(b, 1);
            nan.on_allocated(b, 1);
        }
        assert_eq!((all.len(), none.len(), nan.len()), (64, 0, 0));
    }

    #[test]
    fn sampling_rate_is_met_statistically() {
        // 200k Bernoulli(0.1) draws: mean 20000, sd ~134; 6 sd either side
        let mut r = Residency::new(2, 0.1, 12345).unwrap();
        let hits = (0..200_000).filter(|_| r.should_sample()).count() as f64;
        assert!((hits - 20_000.0).abs() < 6.0 * 134.2, "{hits}");
    }

    #[test]
    fn set_keeps_the_last_four_accesses() {
        let s = Sample::with(1, 9, &[2, 3, 4, 5, 6, 9]);
        assert_eq!(s.history(), &[4, 5, 6, 9]);
    }

    #[test]
    fn the_clock_is_monotonic() {
        let a = now_ns();
        let b = now_ns();
        assert!(a > 0 && b >= a);
    }
}
