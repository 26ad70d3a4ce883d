//! Capacity planning: prefix-cache hit rate against cache capacity.
//!
//! # The model
//!
//! The requests of a trace, in arrival order, go through one vLLM KV cache pool of `C` blocks
//! (`C - 1` usable: block 0 is the null block), each admitted alone and freed at once: what
//! `kvblock sweep`'s *ideal* replay does with the real manager. For request `r` with a prompt of
//! `len` tokens in blocks of `b`: `k = len / b` full blocks with hashes `h_0 .. h_{k-1}`,
//! `n = ceil(len / b)` blocks in all, a partial last block when `b` does not divide `len`.
//!
//! 1. Lookup: the longest prefix of `h_0 .. h_{L-1}` that is cached, `L = min(k, (len - 1) / b)`
//!    (vLLM never hits the last token). A hash cached in several blocks hits its first one.
//! 2. The hit blocks are taken out of the free queue; `n - m` new blocks come from the queue's
//!    head (uncached free blocks first, then the least recently freed cached block: an
//!    eviction).
//! 3. The new full blocks are cached under their hashes (the last block of a prompt that
//!    fills it exactly is cached a second time when its hash is cached already: vLLM keeps
//!    duplicates).
//! 4. Free, in reverse table order: hashed blocks to the queue's tail (so a request's last
//!    block is evicted before its first), the partial block to the head.
//!
//! A request needing more than `C - 1` blocks is unservable at `C` and changes nothing.
//!
//! # One pass for every capacity ([`lru_curve`])
//!
//! The cached part of the free queue is sorted by the key `(request of the last free, -depth)`.
//! Once the pool has evicted anything it holds, after request `r`, exactly the `C - 1 - p_r`
//! cached blocks of largest key (`p_r` = 1 when `r` had a partial block), and before that every
//! cached block. So the pool at every capacity is a prefix of one stack of blocks sorted by key
//! (Mattson et al. 1970): a hash hits at `C` iff the stack depth `d` of its most recent copy is
//! at most `C - 1 - p_{r-1}`. The pass records, for every looked-up block, the smallest such
//! `C`; hits at `C` are a prefix sum. An ancestor block always has a larger key than its
//! descendants, so the hits of a request are a prefix of its blocks at every capacity, as in
//! the pool.
//!
//! Where it is not a stack algorithm, the curve says so ([`Curve::exact_at`]):
//! * at `C` no larger than the most blocks a request needs, that request is unservable there
//!   and skipped, which changes everything after it;
//! * a hash cached in several blocks (the duplicates of 3.) hits its *first* copy: where the
//!   first copy is already evicted but a later one is not, the pool refreshes the later one
//!   and the stack the first; the capacities in between are recorded as inexact.
//!
//! [`simulate`] replays one capacity exactly (the oracle of the tests, and the points the curve
//! cannot give), and also runs the `fifo` and `optimal` (Belady) policies, block by block;
//! [`simulate_many`] replays `optimal` over runs of blocks instead (`optimal`).
//!
//! Stack depths come from a Fenwick tree over requests: the blocks a request stamped and no
//! later request took over always form a suffix of its depths, so a block's depth is the count
//! of such blocks in later requests plus its place in that suffix.

mod optimal;

use std::collections::BinaryHeap;

use hashbrown::HashMap;

use crate::error::{Error, Result};

const NONE: u32 = u32::MAX;

/// The requests of a trace in arrival order: prompt lengths and the interned ids of their full
/// blocks (equal ids are equal block hashes).
#[derive(Debug, Clone)]
pub struct Requests {
    block_size: u64,
    prompt_len: Vec<u64>,
    offsets: Vec<usize>,
    blocks: Vec<u32>,
    num_ids: u32,
}

impl Requests {
    /// Check and wrap: `offsets` has one more entry than `prompt_len`, starts at 0, and request
    /// `i` has exactly `prompt_len[i] / block_size` block ids `blocks[offsets[i]..offsets[i+1]]`.
    pub fn new(block_size: u64, prompt_len: Vec<u64>, offsets: Vec<usize>, blocks: Vec<u32>) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::value("block_size", "must be > 0"));
        }
        if offsets.len() != prompt_len.len() + 1 || offsets[0] != 0 || *offsets.last().unwrap() != blocks.len() {
            return Err(Error::value(
                "offsets",
                "must start at 0, end at len(blocks) and have len(prompt_len) + 1 entries",
            ));
        }
        if prompt_len.len() >= NONE as usize {
            return Err(Error::value("prompt_len", "too many requests"));
        }
        if blocks.len() >= NONE as usize {
            return Err(Error::value("blocks", "too many blocks (at most 2**32 - 2)"));
        }
        for (i, &len) in prompt_len.iter().enumerate() {
            if len == 0 {
                return Err(Error::value("prompt_len", format!("request {i} has an empty prompt")));
            }
            let (a, b) = (offsets[i], offsets[i + 1]);
            if b < a || (b - a) as u64 != len / block_size {
                return Err(Error::value(
                    "offsets",
                    format!("request {i} has {} block ids for {} full blocks", b.wrapping_sub(a), len / block_size),
                ));
            }
        }
        let num_ids = match blocks.iter().max() {
            Some(&m) if m == NONE => return Err(Error::value("blocks", "ids must be < 2**32 - 1")),
            Some(&m) => m + 1,
            None => 0,
        };
        Ok(Requests { block_size, prompt_len, offsets, blocks, num_ids })
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.prompt_len.len()
    }

    /// True when there are no requests.
    pub fn is_empty(&self) -> bool {
        self.prompt_len.is_empty()
    }

    /// The most blocks one request needs.
    pub fn max_blocks_needed(&self) -> u64 {
        (0..self.len()).map(|r| self.shape(r).2).max().unwrap_or(0)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    #[inline]
    fn full(&self, r: usize) -> &[u32] {
        &self.blocks[self.offsets[r]..self.offsets[r + 1]]
    }

    /// `(k, L, n, partial)` of request `r` (see the module docs).
    #[inline]
    fn shape(&self, r: usize) -> (usize, usize, u64, bool) {
        let len = self.prompt_len[r];
        let b = self.block_size;
        let k = (len / b) as usize;
        let lim = (((len - 1) / b) as usize).min(k);
        (k, lim, len.div_ceil(b), !len.is_multiple_of(b))
    }
}

/// Interned block ids of hash-id traces (Mooncake: one id per `trace_block_size` tokens, a
/// multiple of `block_size`), without expanding tokens: the blocks of trace id `h` after the
/// prefix `P` are a function of `(P, h)` (vLLM's digests chain from the parent's), so each
/// distinct `(parent node, h)` of the trie of id prefixes gets a node `v`, and its
/// `s`-th sub-block the id `v * (trace_block_size / block_size) + s`. Two prompts get equal ids
/// exactly where `kvblock.replay.RequestHasher`'s memo (keyed by parent digest and id) gives
/// equal digests.
///
/// Returns `(offsets, blocks)` for [`Requests::new`]: each request's `prompt_len / block_size`
/// full blocks, or fewer when its ids cover fewer tokens.
pub fn trie_block_ids(
    hash_ids: &[i64],
    id_offsets: &[usize],
    prompt_len: &[u64],
    trace_block_size: u64,
    block_size: u64,
) -> Result<(Vec<usize>, Vec<u32>)> {
    if block_size == 0 || trace_block_size == 0 || !trace_block_size.is_multiple_of(block_size) {
        return Err(Error::value("trace_block_size", "must be a positive multiple of block_size"));
    }
    if id_offsets.len() != prompt_len.len() + 1 || id_offsets[0] != 0 || *id_offsets.last().unwrap() != hash_ids.len() {
        return Err(Error::value(
            "id_offsets",
            "must start at 0, end at len(hash_ids) and have len(prompt_len) + 1 entries",
        ));
    }
    let k = (trace_block_size / block_size) as usize;
    let mut nodes: HashMap<(u32, i64), u32> = HashMap::with_capacity(hash_ids.len().min(1 << 24));
    let mut offsets = Vec::with_capacity(prompt_len.len() + 1);
    offsets.push(0usize);
    let mut blocks: Vec<u32> = Vec::new();
    let limit = (NONE as u64 - 1) / k as u64;
    for (r, &len) in prompt_len.iter().enumerate() {
        let (a, b) = (id_offsets[r], id_offsets[r + 1]);
        if b < a {
            return Err(Error::value("id_offsets", "must not decrease"));
        }
        let mut need = (len / block_size) as usize;
        let mut parent = NONE;
        for &h in &hash_ids[a..b] {
            if need == 0 {
                break;
            }
            let next = nodes.len() as u32;
            let v = *nodes.entry((parent, h)).or_insert(next);
            if v as u64 >= limit {
                return Err(Error::value("hash_ids", "too many distinct trace blocks for 32-bit block ids"));
            }
            let take = need.min(k);
            let base = v * k as u32;
            blocks.extend(base..base + take as u32);
            need -= take;
            parent = v;
        }
        offsets.push(blocks.len());
    }
    Ok((offsets, blocks))
}

impl Requests {
    /// The requests of a hash-id trace with [`trie_block_ids`]'s ids, without a round trip
    /// through the caller: a record whose ids cover fewer tokens than its length is taken as
    /// the prompt they cover (at least one token).
    pub fn from_trie_ids(
        hash_ids: &[i64],
        id_offsets: &[usize],
        prompt_len: &[u64],
        trace_block_size: u64,
        block_size: u64,
    ) -> Result<Self> {
        let (offsets, blocks) = trie_block_ids(hash_ids, id_offsets, prompt_len, trace_block_size, block_size)?;
        let lens = prompt_len
            .iter()
            .zip(offsets.windows(2))
            .map(|(&len, w)| {
                let have = (w[1] - w[0]) as u64;
                if have < len / block_size {
                    (have * block_size).max(1)
                } else {
                    len
                }
            })
            .collect();
        Requests::new(block_size, lens, offsets, blocks)
    }
}

/// The later copies of hashes cached more than once (rare: the last block of a prompt that
/// fills it exactly), behind a bitset so that the common lookup costs one bit test.
struct Copies {
    has: Vec<u64>,
    map: HashMap<u32, Vec<u32>>,
}

impl Copies {
    fn new(num_ids: u32) -> Self {
        Copies { has: vec![0; (num_ids as usize).div_ceil(64)], map: HashMap::new() }
    }
    #[inline]
    fn marked(&self, h: u32) -> bool {
        self.has[h as usize / 64] >> (h % 64) & 1 == 1
    }
    #[inline]
    fn get(&self, h: u32) -> Option<&Vec<u32>> {
        if self.marked(h) {
            self.map.get(&h)
        } else {
            None
        }
    }
    #[inline]
    fn get_mut(&mut self, h: u32) -> Option<&mut Vec<u32>> {
        if self.marked(h) {
            self.map.get_mut(&h)
        } else {
            None
        }
    }
    fn push(&mut self, h: u32, copy: u32) {
        self.has[h as usize / 64] |= 1 << (h % 64);
        self.map.entry(h).or_default().push(copy);
    }
}

/// Fenwick tree of counts over request indices.
struct Fenwick {
    t: Vec<i64>,
    total: i64,
}

impl Fenwick {
    fn new(n: usize) -> Self {
        Fenwick { t: vec![0; n + 1], total: 0 }
    }
    fn add(&mut self, i: usize, v: i64) {
        self.total += v;
        let mut i = i + 1;
        while i < self.t.len() {
            self.t[i] += v;
            i += i & i.wrapping_neg();
        }
    }
    /// Sum over indices `< i`.
    fn prefix(&self, i: usize) -> i64 {
        let mut s = 0;
        let mut i = i;
        while i > 0 {
            s += self.t[i];
            i &= i - 1;
        }
        s
    }
    /// Sum over indices `>= i`.
    fn suffix(&self, i: usize) -> i64 {
        self.total - self.prefix(i)
    }
}

/// One capacity's result, counted over the measured requests (index `>= warm_from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Point {
    /// `num_blocks` (the null block included).
    pub num_blocks: u64,
    /// Prompt tokens of the measured requests.
    pub prompt_tokens: u64,
    /// Prompt tokens of the measured requests that were served (vLLM's `queries`).
    pub queries: u64,
    /// Prompt tokens served from the cache (vLLM's `hits`).
    pub hits: u64,
    /// Measured requests too large for the cache, and their prompt tokens.
    pub unservable: u64,
    pub unservable_tokens: u64,
    /// Cached blocks evicted while the measured requests were served.
    pub evictions: u64,
}

/// The LRU hit curve of [`lru_curve`]: hits at every capacity from one pass.
#[derive(Debug, Clone)]
pub struct Curve {
    block_size: u64,
    warm_from: usize,
    /// `hist[c]`: block lookups (of measured / of earlier requests) that hit at every
    /// `num_blocks >= c`.
    hist_measured: Vec<u32>,
    hist_warmup: Vec<u32>,
    /// `[lo, hi)` ranges of `num_blocks` where duplicates make the stack inexact.
    taint: Vec<(u64, u64)>,
    max_need: u64,
    prompt_tokens: u64,
    full_warmup: u64,
    full_all: u64,
    partial_last_warmup: u64,
    partial_last: u64,
}

impl Curve {
    /// True if [`Curve::point`] equals [`simulate`]'s LRU at `num_blocks`: no request is
    /// unservable there and no duplicate-copy range covers it.
    pub fn exact_at(&self, num_blocks: u64) -> bool {
        num_blocks > self.max_need && !self.taint.iter().any(|&(lo, hi)| lo <= num_blocks && num_blocks < hi)
    }

    /// The most blocks one request needs (capacities up to this one are not exact).
    pub fn max_blocks_needed(&self) -> u64 {
        self.max_need
    }

    /// The `[lo, hi)` ranges of `num_blocks` that duplicate copies make inexact, merged.
    pub fn inexact_ranges(&self) -> Vec<(u64, u64)> {
        let mut t = self.taint.clone();
        t.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (lo, hi) in t {
            match out.last_mut() {
                Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        out
    }

    /// Block hits of the measured requests at every `num_blocks` from 0 to the largest that
    /// changes anything (hits at larger capacities equal the last entry).
    pub fn cumulative_hits(&self) -> Vec<u64> {
        let mut acc = 0;
        self.hist_measured
            .iter()
            .map(|&h| {
                acc += h as u64;
                acc * self.block_size
            })
            .collect()
    }

    fn block_hits(hist: &[u32], num_blocks: u64) -> u64 {
        let end = (num_blocks as usize).saturating_add(1).min(hist.len());
        hist[..end].iter().map(|&h| h as u64).sum()
    }

    /// The point at `num_blocks` (meaningful where [`Curve::exact_at`]; elsewhere the stack's
    /// value, not the pool's).
    pub fn point(&self, num_blocks: u64) -> Point {
        let measured = Self::block_hits(&self.hist_measured, num_blocks);
        let warm = Self::block_hits(&self.hist_warmup, num_blocks);
        let usable = num_blocks.saturating_sub(1) as i128;
        // Evictions until request t: max(0, cached blocks created + p_{t-1} - (C - 1)).
        let evicted = |full: u64, hit_blocks: u64, p: u64| -> u64 {
            (full as i128 - hit_blocks as i128 + p as i128 - usable).max(0) as u64
        };
        let e_all = evicted(self.full_all, measured + warm, self.partial_last);
        let e_warm = if self.warm_from == 0 { 0 } else { evicted(self.full_warmup, warm, self.partial_last_warmup) };
        Point {
            num_blocks,
            prompt_tokens: self.prompt_tokens,
            queries: self.prompt_tokens,
            hits: measured * self.block_size,
            unservable: 0,
            unservable_tokens: 0,
            evictions: e_all - e_warm,
        }
    }
}

/// The LRU curve of `reqs` in one pass (see the module docs); requests before `warm_from`
/// warm the cache and are not counted.
pub fn lru_curve(reqs: &Requests, warm_from: usize) -> Result<Curve> {
    let n = reqs.len();
    let mut fen = Fenwick::new(n);
    let mut alive_from = vec![0u32; n]; // a_q: first depth request q still holds
    let mut first = vec![NONE; reqs.num_ids as usize]; // hash id -> request holding its first copy
    let mut extra = Copies::new(reqs.num_ids); // hash id -> requests holding later copies
                                               // Counts fit: lookups are fewer than the blocks, which have u32 item ids.
    let mut hist_measured: Vec<u32> = Vec::new();
    let mut hist_warmup: Vec<u32> = Vec::new();
    let mut taint = Vec::new();
    let mut runs: Vec<(u32, usize, usize)> = Vec::new();
    let (mut max_need, mut prompt_tokens, mut full_warmup, mut full_all) = (0u64, 0u64, 0u64, 0u64);
    let (mut partial_last_warmup, mut p_prev) = (0u64, 0u64);
    for r in 0..n {
        let blocks = reqs.full(r);
        let (k, lim, need, partial) = reqs.shape(r);
        max_need = max_need.max(need);
        let measured = r >= warm_from;
        if measured {
            prompt_tokens += reqs.prompt_len[r];
        }
        // 1. Stack depths of the looked-up blocks, against the state before r.
        runs.clear();
        let mut m = 0usize;
        let mut base = 0u64;
        while m < lim {
            let h = blocks[m];
            let q = first[h as usize];
            if q == NONE {
                break;
            }
            match runs.last_mut() {
                Some(run) if run.0 == q => run.2 = m + 1,
                _ => {
                    if alive_from[q as usize] as usize != m {
                        return Err(Error::State(format!(
                            "capacity curve: request {r} reaches request {q}'s blocks at depth {m}, not at its first held depth {}",
                            alive_from[q as usize]
                        )));
                    }
                    base = fen.suffix(q as usize + 1) as u64;
                    runs.push((q, m, m + 1));
                }
            }
            let start = runs.last().unwrap().1;
            let depth = base + (m - start) as u64 + 1;
            let mut best = depth;
            if let Some(copies) = extra.get(h) {
                for &c in copies {
                    let oq = c as usize;
                    let d = fen.suffix(oq + 1) as u64 + (m as u64 - alive_from[oq] as u64) + 1;
                    best = best.min(d);
                }
                if best < depth {
                    taint.push((best + 1 + p_prev, depth + 1 + p_prev));
                }
            }
            let c = (best + 1 + p_prev) as usize;
            let hist = if measured { &mut hist_measured } else { &mut hist_warmup };
            if hist.len() <= c {
                hist.resize(c + 1, 0);
            }
            hist[c] += 1;
            m += 1;
        }
        // 2. The blocks r refreshed move to r; its other full blocks are new copies.
        for &(q, a, b) in &runs {
            fen.add(q as usize, -((b - a) as i64));
            alive_from[q as usize] = b as u32;
            for &h in &blocks[a..b] {
                first[h as usize] = r as u32;
            }
        }
        for (j, &h) in blocks.iter().enumerate().skip(m) {
            if first[h as usize] == NONE {
                first[h as usize] = r as u32;
            } else if j + 1 == k && lim < k {
                extra.push(h, r as u32);
            } else {
                return Err(Error::State(format!(
                    "capacity curve: request {r}'s block {j} is cached although block {m} is not"
                )));
            }
        }
        fen.add(r, k as i64);
        full_all += k as u64;
        p_prev = partial as u64;
        if r + 1 == warm_from {
            full_warmup = full_all;
            partial_last_warmup = p_prev;
        }
    }
    let len = hist_measured.len().max(hist_warmup.len());
    hist_measured.resize(len, 0);
    Ok(Curve {
        block_size: reqs.block_size,
        warm_from,
        hist_measured,
        hist_warmup,
        taint,
        max_need,
        prompt_tokens,
        full_warmup,
        full_all,
        partial_last_warmup,
        partial_last: p_prev,
    })
}

/// Which cached free block an allocation evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// vLLM's free queue: the least recently freed; within a request its last block first.
    Lru,
    /// The block cached earliest (hits do not refresh it); within a request its last block
    /// first.
    Fifo,
    /// Belady: the block whose next lookup is farthest (never looked up again first, a
    /// duplicate copy before all); ties: the deepest block first, so a kept block's prefix is
    /// kept too.
    Optimal,
}

impl Policy {
    /// `"lru"`, `"fifo"` or `"optimal"`.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "lru" => Ok(Policy::Lru),
            "fifo" => Ok(Policy::Fifo),
            "optimal" => Ok(Policy::Optimal),
            _ => Err(Error::value("policy", format!("unknown policy {name:?}; choose from lru, fifo, optimal"))),
        }
    }
}

/// Doubly linked list over slots (the free queue of `lru`, the birth order of `fifo`).
#[derive(Default)]
struct List {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
}

impl List {
    fn new() -> Self {
        List { prev: Vec::new(), next: Vec::new(), head: NONE, tail: NONE }
    }
    fn grow(&mut self, slots: usize) {
        self.prev.resize(slots, NONE);
        self.next.resize(slots, NONE);
    }
    fn push_back(&mut self, s: u32) {
        self.prev[s as usize] = self.tail;
        self.next[s as usize] = NONE;
        if self.tail == NONE {
            self.head = s;
        } else {
            self.next[self.tail as usize] = s;
        }
        self.tail = s;
    }
    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p == NONE {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NONE {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
    }
}

/// The cached free blocks, ordered by the policy.
enum FreeSet {
    /// vLLM's free queue (cached part): touch unlinks, free appends, evict pops the head.
    Lru(List),
    /// Every cached block in birth order, pinned ones included (skipped by eviction).
    Fifo(List),
    /// Per next-use request a max-heap of `(depth, slot)`, `order` the non-empty ones'
    /// indices; `useless`: duplicate copies, then blocks never looked up again (evicted first,
    /// in any order: no future hit depends on them).
    Opt { buckets: Vec<BinaryHeap<(u32, u32)>>, order: BinaryHeap<u32>, dups: Vec<u32>, never: Vec<u32> },
}

/// Replay `reqs` at one capacity with `policy` (the model of the module docs, block by block).
/// `num_blocks`: the pool including the null block (at least 2; `u64::MAX`: unlimited).
pub fn simulate(reqs: &Requests, num_blocks: u64, policy: Policy, warm_from: usize) -> Result<Point> {
    if num_blocks < 2 {
        return Err(Error::value("num_blocks", "must be >= 2 (block 0 is the null block)"));
    }
    let usable = num_blocks - 1;
    let n = reqs.len();
    let servable = |r: usize| reqs.shape(r).2 <= usable;
    // Next lookup of each (request, block) by a servable request, for Belady.
    let next_use: Vec<u32> = if policy == Policy::Optimal {
        let mut last = vec![NONE; reqs.num_ids as usize];
        let mut next = vec![NONE; reqs.blocks.len()];
        for r in (0..n).rev() {
            if !servable(r) {
                continue;
            }
            let (_, lim, _, _) = reqs.shape(r);
            let off = reqs.offsets[r];
            for (j, &h) in reqs.full(r).iter().enumerate() {
                next[off + j] = last[h as usize];
            }
            for &h in &reqs.full(r)[..lim] {
                last[h as usize] = r as u32;
            }
        }
        next
    } else {
        Vec::new()
    };
    let mut free = match policy {
        Policy::Lru => FreeSet::Lru(List::new()),
        Policy::Fifo => FreeSet::Fifo(List::new()),
        Policy::Optimal => FreeSet::Opt {
            buckets: (0..n).map(|_| BinaryHeap::new()).collect(),
            order: BinaryHeap::new(),
            dups: Vec::new(),
            never: Vec::new(),
        },
    };
    let mut first = vec![NONE; reqs.num_ids as usize];
    let mut extra = Copies::new(reqs.num_ids);
    let mut slot_hash: Vec<u32> = Vec::new();
    let mut pinned_by: Vec<u32> = Vec::new(); // request holding the slot, or NONE
    let mut spare: Vec<u32> = Vec::new(); // slots of uncached free blocks
    let mut uncached = usable; // uncached free blocks (the queue's head)
    let mut table: Vec<u32> = Vec::new();
    let mut born: Vec<u32> = Vec::new();
    let mut pt = Point { num_blocks, ..Point::default() };
    for r in 0..n {
        let blocks = reqs.full(r);
        let (k, lim, need, _) = reqs.shape(r);
        let measured = r >= warm_from;
        let len = reqs.prompt_len[r];
        if measured {
            pt.prompt_tokens += len;
        }
        if need > usable {
            if measured {
                pt.unservable += 1;
                pt.unservable_tokens += len;
            }
            continue;
        }
        let mut m = 0;
        while m < lim && first[blocks[m] as usize] != NONE {
            m += 1;
        }
        table.clear();
        for &h in &blocks[..m] {
            let s = first[h as usize];
            pinned_by[s as usize] = r as u32;
            if let FreeSet::Lru(list) = &mut free {
                list.unlink(s);
            }
            table.push(s);
        }
        if let FreeSet::Opt { buckets, .. } = &mut free {
            // the blocks whose next lookup is r are exactly r's hits: out of the free set
            buckets[r].clear();
        }
        born.clear();
        let mut cursor = NONE;
        #[allow(clippy::needless_range_loop)] // j indexes the blocks and counts the new ones
        for j in m..need as usize {
            let s = if uncached > 0 {
                uncached -= 1;
                match spare.pop() {
                    Some(s) => s,
                    None => {
                        if slot_hash.len() >= NONE as usize - 1 {
                            return Err(Error::value("num_blocks", "too many blocks to simulate"));
                        }
                        slot_hash.push(NONE);
                        pinned_by.push(NONE);
                        let slots = slot_hash.len();
                        if let FreeSet::Lru(list) | FreeSet::Fifo(list) = &mut free {
                            list.grow(slots);
                        }
                        (slots - 1) as u32
                    }
                }
            } else {
                let victim = match &mut free {
                    FreeSet::Lru(list) => {
                        let s = list.head;
                        if s != NONE {
                            list.unlink(s);
                        }
                        s
                    }
                    FreeSet::Fifo(list) => {
                        let mut s = if cursor == NONE { list.head } else { cursor };
                        while s != NONE && pinned_by[s as usize] == r as u32 {
                            s = list.next[s as usize];
                        }
                        if s != NONE {
                            cursor = list.next[s as usize];
                            list.unlink(s);
                        }
                        s
                    }
                    FreeSet::Opt { buckets, order, dups, never } => loop {
                        if let Some(s) = dups.pop().or_else(|| never.pop()) {
                            break s;
                        }
                        let Some(&b) = order.peek() else { break NONE };
                        match buckets[b as usize].pop() {
                            Some((_, s)) => break s,
                            None => {
                                order.pop();
                            }
                        }
                    },
                };
                if victim == NONE {
                    return Err(Error::State(format!("simulate: no free block for request {r}")));
                }
                let s = victim;
                let h = slot_hash[s as usize];
                if first[h as usize] == s {
                    first[h as usize] = match extra.get_mut(h) {
                        Some(v) if !v.is_empty() => v.remove(0),
                        _ => NONE,
                    };
                } else if let Some(v) = extra.get_mut(h) {
                    v.retain(|&x| x != s);
                }
                if measured {
                    pt.evictions += 1;
                }
                s
            };
            pinned_by[s as usize] = r as u32;
            if j < k {
                let h = blocks[j];
                slot_hash[s as usize] = h;
                if first[h as usize] == NONE {
                    first[h as usize] = s;
                } else {
                    extra.push(h, s);
                }
                born.push(s);
            } else {
                slot_hash[s as usize] = NONE;
            }
            table.push(s);
        }
        if let FreeSet::Fifo(list) = &mut free {
            for &s in born.iter().rev() {
                list.push_back(s);
            }
        }
        // Free in reverse order: hashed blocks to the free set, the partial one to the head.
        let off = reqs.offsets[r];
        for (j, &s) in table.iter().enumerate().rev() {
            pinned_by[s as usize] = NONE;
            if j >= k {
                uncached += 1;
                spare.push(s);
                continue;
            }
            match &mut free {
                FreeSet::Lru(list) => list.push_back(s),
                FreeSet::Fifo(_) => {}
                FreeSet::Opt { buckets, order, dups, never } => {
                    let b = next_use[off + j];
                    if first[blocks[j] as usize] != s {
                        dups.push(s);
                        continue;
                    } else if b == NONE {
                        never.push(s);
                        continue;
                    }
                    let bucket = &mut buckets[b as usize];
                    if bucket.is_empty() {
                        order.push(b);
                    }
                    bucket.push((j as u32, s));
                }
            }
        }
        if measured {
            pt.queries += len;
            pt.hits += m as u64 * reqs.block_size;
        }
    }
    Ok(pt)
}

/// [`simulate`] at several capacities, on up to `threads` threads (results in input order);
/// `optimal` through `optimal::replay` (runs of blocks), falling back to [`simulate`] where
/// the ids are not chained.
pub fn simulate_many(
    reqs: &Requests,
    capacities: &[u64],
    policy: Policy,
    warm_from: usize,
    threads: usize,
) -> Result<Vec<Point>> {
    // The next lookups with every request served, shared; each worker derives a capacity's
    // where some request is unservable.
    let all = if policy == Policy::Optimal { optimal::next_uses(reqs) } else { None };
    let one = |c: u64, scratch: &mut optimal::Scratch| -> Result<Point> {
        match all.as_ref() {
            Some(all) if c >= 2 => match optimal::replay(reqs, c, warm_from, all, scratch)? {
                Some(p) => Ok(p),
                None => simulate(reqs, c, policy, warm_from),
            },
            _ => simulate(reqs, c, policy, warm_from),
        }
    };
    let threads = threads.clamp(1, capacities.len().max(1));
    if threads == 1 {
        let mut scratch = optimal::Scratch::default();
        return capacities.iter().map(|&c| one(c, &mut scratch)).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<Result<Point>>> = (0..capacities.len()).map(|_| None).collect();
    let results = std::sync::Mutex::new(&mut out);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut scratch = optimal::Scratch::default();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= capacities.len() {
                        break;
                    }
                    let p = one(capacities[i], &mut scratch);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(p);
                }
            });
        }
    });
    out.into_iter().map(|p| p.unwrap_or_else(|| Err(Error::State("simulate_many: a worker failed".into())))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random requests sharing prefixes, some prompts exact multiples (duplicates).
    fn random_requests(seed: u64, n: usize, b: u64) -> Requests {
        let mut x = seed;
        let mut rnd = move |m: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let mut prefixes: Vec<Vec<u32>> = vec![vec![]];
        let mut next_id = 0u32;
        let (mut lens, mut offsets, mut blocks) = (vec![], vec![0usize], vec![]);
        for _ in 0..n {
            let base = prefixes[rnd(prefixes.len() as u64) as usize].clone();
            let keep = if base.is_empty() { 0 } else { rnd(base.len() as u64 + 1) as usize };
            let mut chain: Vec<u32> = base[..keep].to_vec();
            for _ in 0..rnd(6) {
                chain.push(next_id);
                next_id += 1;
            }
            let k = chain.len() as u64;
            let len = if rnd(3) == 0 || k == 0 { k * b + 1 + rnd(b - 1) } else { k * b };
            if len == 0 {
                continue;
            }
            lens.push(len);
            blocks.extend_from_slice(&chain);
            offsets.push(blocks.len());
            prefixes.push(chain);
        }
        Requests::new(b, lens, offsets, blocks).unwrap()
    }

    #[test]
    fn curve_equals_replays_where_exact() {
        for seed in 0..40 {
            let reqs = random_requests(seed, 60, 4);
            for warm in [0, 20] {
                let curve = lru_curve(&reqs, warm).unwrap();
                let mut exact = 0;
                for c in 2..200 {
                    let sim = simulate(&reqs, c, Policy::Lru, warm).unwrap();
                    if curve.exact_at(c) {
                        assert_eq!(curve.point(c), sim, "seed {seed} warm {warm} capacity {c}");
                        exact += 1;
                    }
                }
                assert!(exact > 30, "seed {seed}: only {exact} exact capacities");
            }
        }
    }

    #[test]
    fn optimal_beats_lru_and_fifo() {
        for seed in 0..20 {
            let reqs = random_requests(seed, 80, 4);
            for c in [4, 8, 16, 32, 64] {
                let o = simulate(&reqs, c, Policy::Optimal, 0).unwrap();
                let l = simulate(&reqs, c, Policy::Lru, 0).unwrap();
                let f = simulate(&reqs, c, Policy::Fifo, 0).unwrap();
                assert!(o.hits >= l.hits && o.hits >= f.hits, "seed {seed} capacity {c}");
            }
        }
    }

    #[test]
    fn optimal_runs_equal_the_block_by_block_replay() {
        for seed in 0..60 {
            let reqs = random_requests(seed, 80, 4);
            for warm in [0, 30] {
                let caps: Vec<u64> = (2..120).chain([500, u64::MAX]).collect();
                let fast = simulate_many(&reqs, &caps, Policy::Optimal, warm, 2).unwrap();
                for (&c, f) in caps.iter().zip(&fast) {
                    let slow = simulate(&reqs, c, Policy::Optimal, warm).unwrap();
                    assert_eq!(*f, slow, "seed {seed} warm {warm} capacity {c}");
                }
                let all = optimal::next_uses(&reqs).unwrap();
                let mut scratch = optimal::Scratch::default();
                for c in [8, 64] {
                    let p = optimal::replay(&reqs, c, warm, &all, &mut scratch).unwrap();
                    assert!(p.is_some(), "seed {seed} capacity {c}: fell back");
                }
            }
        }
    }

    /// Hash-id requests (trace blocks of 4 blocks) sharing prefixes, lengths that end inside a
    /// trace block, on a block boundary, or short of their ids.
    fn random_trie_requests(seed: u64, n: usize) -> Requests {
        let mut x = seed;
        let mut rnd = move |m: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let (tbs, b) = (8u64, 2u64);
        let mut prefixes: Vec<Vec<i64>> = vec![vec![]];
        let (mut ids, mut id_offsets, mut lens) = (vec![], vec![0usize], vec![]);
        for _ in 0..n {
            let base = &prefixes[rnd(prefixes.len() as u64) as usize];
            let keep = rnd(base.len() as u64 + 1) as usize;
            let mut chain = base[..keep].to_vec();
            for _ in 0..=rnd(4) {
                chain.push(rnd(1 << 40) as i64);
            }
            let full = chain.len() as u64 * tbs;
            let len = match rnd(4) {
                0 => full,
                1 => full - rnd(tbs) - 1,
                2 => full - tbs + b * (1 + rnd(tbs / b - 1)),
                _ => full + tbs * rnd(2), // ids short of the length: the prompt is what they cover
            };
            ids.extend_from_slice(&chain);
            id_offsets.push(ids.len());
            lens.push(len.max(1));
            prefixes.push(chain);
        }
        Requests::from_trie_ids(&ids, &id_offsets, &lens, tbs, b).unwrap()
    }

    #[test]
    fn optimal_runs_equal_the_block_by_block_replay_on_trie_ids() {
        for seed in 0..40 {
            let reqs = random_trie_requests(seed, 70);
            let max_need = reqs.max_blocks_needed();
            let caps: Vec<u64> = (2..3 * max_need + 40).step_by(3).chain([u64::MAX]).collect();
            for warm in [0, 35] {
                let fast = simulate_many(&reqs, &caps, Policy::Optimal, warm, 2).unwrap();
                for (&c, f) in caps.iter().zip(&fast) {
                    assert_eq!(*f, simulate(&reqs, c, Policy::Optimal, warm).unwrap(), "seed {seed} capacity {c}");
                }
            }
            let all = optimal::next_uses(&reqs).unwrap();
            let p = optimal::replay(&reqs, max_need / 2 + 2, 0, &all, &mut optimal::Scratch::default()).unwrap();
            assert!(p.is_some(), "seed {seed}: fell back");
        }
    }

    #[test]
    fn optimal_falls_back_on_ids_that_are_not_chained() {
        // the same id at two depths: next lookups decrease along a request
        let reqs =
            Requests::new(4, vec![12, 12, 8, 12], vec![0, 3, 6, 8, 11], vec![0, 1, 2, 2, 1, 0, 2, 1, 1, 2, 0]).unwrap();
        assert!(optimal::next_uses(&reqs).is_none());
        for c in 2..16 {
            let fast = simulate_many(&reqs, &[c], Policy::Optimal, 0, 1).unwrap();
            assert_eq!(fast[0], simulate(&reqs, c, Policy::Optimal, 0).unwrap(), "capacity {c}");
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(Requests::new(0, vec![1], vec![0, 0], vec![]).is_err());
        assert!(Requests::new(4, vec![8], vec![0, 1], vec![0]).is_err());
        assert!(Requests::new(4, vec![0], vec![0, 0], vec![]).is_err());
        let r = Requests::new(4, vec![8], vec![0, 2], vec![0, 1]).unwrap();
        assert!(simulate(&r, 1, Policy::Lru, 0).is_err());
        assert!(simulate_many(&r, &[2, 1], Policy::Optimal, 0, 2).is_err());
        assert!(Policy::from_name("mru").is_err());
        assert!(trie_block_ids(&[1], &[0, 1], &[8], 6, 4).is_err());
        assert!(Requests::from_trie_ids(&[1], &[0, 1], &[8], 6, 4).is_err());
        assert!(Requests::from_trie_ids(&[1], &[0, 2], &[8], 8, 4).is_err());
        // ids covering fewer tokens than the length: the prompt is what they cover
        let short = Requests::from_trie_ids(&[1], &[0, 1], &[20], 8, 4).unwrap();
        assert_eq!((short.prompt_len.clone(), short.max_blocks_needed()), (vec![8], 2));
    }
}
