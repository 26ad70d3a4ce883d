//! Criterion benchmark of priority retention's eviction (pure Rust, no Python): one round
//! takes 1024 blocks from a full pool of cached blocks (each one evicted: the least recently
//! used block of the lowest priority present), caches them under fresh keys, gives them
//! priorities and frees them in a shuffled order (the steady state of a busy prefix cache;
//! shuffled so that plain LRU, too, evicts scattered block ids). Three pools per size: plain
//! LRU (retention off, vLLM's queue), retention on with every block at one level, and retention
//! on with priorities spread over all 101 levels; 10^4, 10^5 and 10^6 blocks. Throughput is per
//! block. `cargo bench --bench retention`.

use _core::hashing::Digest;
use _core::pool::block_pool::BlockPool;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;

mod common;
use common::splitmix64;

const K: usize = 1024;

/// A permutation of `0..n` (Fisher-Yates driven by splitmix64).
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (splitmix64(seed ^ i as u64) % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// One pool, its next fresh key, and the inputs every round reuses.
struct Bench {
    pool: BlockPool,
    next_key: u64,
    keys: Vec<Digest>,
    ids: Vec<u32>,
    shuffled: Vec<u32>,
    perm: Vec<usize>,
    prios: Vec<u8>,
}

impl Bench {
    fn new(num_blocks: usize, mode: &str) -> Self {
        let mut pool = BlockPool::new(num_blocks, true, 16, false).unwrap();
        if mode != "lru" {
            pool.enable_retention(35, 1.0).unwrap();
        }
        pool.set_time(0.0).unwrap();
        let usable = num_blocks - 1;
        let mut every = Vec::new();
        pool.get_new_blocks(usable, &mut every).unwrap();
        let order: Vec<u32> = permutation(usable, 1).into_iter().map(|i| every[i]).collect();
        pool.free_blocks(&order, true).unwrap();
        let prios =
            (0..K as u64).map(|i| if mode == "101 levels" { (splitmix64(i ^ 77) % 101) as u8 } else { 35 }).collect();
        let mut b = Bench {
            pool,
            next_key: 0,
            keys: Vec::with_capacity(K),
            ids: Vec::with_capacity(K),
            shuffled: vec![0; K],
            perm: permutation(K, 2),
            prios,
        };
        for _ in 0..usable / K {
            b.round();
        }
        b
    }

    /// Take, cache, prioritise and free 1024 blocks.
    #[inline]
    fn round(&mut self) {
        self.keys.clear();
        for _ in 0..K {
            let k = self.next_key;
            self.next_key += 1;
            let mut raw = [0u8; 16];
            raw[..8].copy_from_slice(&splitmix64(k).to_le_bytes());
            raw[8..].copy_from_slice(&splitmix64(!k).to_le_bytes());
            self.keys.push(Digest::from_slice(&raw).unwrap());
        }
        self.ids.clear();
        self.pool.get_new_blocks(K, &mut self.ids).unwrap();
        self.pool.cache_full_blocks(&self.ids, 0, K, &self.keys, 16, 0, None, 0).unwrap();
        for (&b, &p) in self.ids.iter().zip(&self.prios) {
            self.pool.assign_retention(b, p, None);
        }
        for (dst, &i) in self.shuffled.iter_mut().zip(&self.perm) {
            *dst = self.ids[i];
        }
        self.pool.free_blocks(&self.shuffled, true).unwrap();
    }
}

fn bench_eviction(c: &mut Criterion) {
    for num_blocks in [10_000usize, 100_000, 1_000_000] {
        let mut g = c.benchmark_group(format!("evict_cache_free_{num_blocks}_blocks"));
        g.throughput(Throughput::Elements(K as u64));
        g.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
        for mode in ["lru", "1 level", "101 levels"] {
            let mut b = Bench::new(num_blocks, mode);
            g.bench_function(BenchmarkId::from_parameter(mode), |bench| {
                bench.iter(|| {
                    b.round();
                    black_box(b.pool.num_free_blocks())
                })
            });
            b.pool.check_invariants().unwrap();
        }
        g.finish();
    }
}

criterion_group!(benches, bench_eviction);
criterion_main!(benches);
