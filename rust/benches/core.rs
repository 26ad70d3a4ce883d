//! Criterion benchmarks of the pure-Rust core (no Python): block hashing per algorithm.

use _core::hashing::{BlockHasher, HashAlgo};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;

mod common;
use common::splitmix64;

fn prompt() -> Vec<i64> {
    (0..4096u64).map(|i| (splitmix64((1234567u64 << 40) | (1048000 << 20) | i) % 128000) as i64).collect()
}

fn bench_hashing(c: &mut Criterion) {
    let tokens = prompt();
    let root = [7u8; 32];
    let mut g = c.benchmark_group("hash_chain_4096_tokens_bs16");
    g.throughput(Throughput::Elements(256));
    for algo in [HashAlgo::Sha256, HashAlgo::Sha256Cbor, HashAlgo::Xxhash, HashAlgo::XxhashCbor] {
        let mut h = BlockHasher::new(algo);
        g.bench_with_input(BenchmarkId::from_parameter(algo.name()), &tokens, |b, t| {
            b.iter(|| black_box(h.hash_chain(0, &root, black_box(t), 16, |_| None).unwrap()))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("serialize_block_16");
    for algo in [HashAlgo::Sha256, HashAlgo::Sha256Cbor] {
        let mut h = BlockHasher::new(algo);
        g.bench_function(algo.name(), |b| {
            b.iter(|| black_box(h.serialize_block(0, &root, black_box(&tokens[160..176]), None).unwrap().len()))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("digest_only_115_bytes");
    let data = [0x5au8; 115];
    for algo in [HashAlgo::Sha256, HashAlgo::Xxhash] {
        g.bench_function(algo.name(), |b| b.iter(|| black_box(algo.digest(black_box(&data)))));
    }
    g.finish();
}

criterion_group!(benches, bench_hashing);

fn bench_pool(c: &mut Criterion) {
    use _core::hashing::Digest;
    use _core::pool::block_pool::BlockPool;
    let mut pool = BlockPool::new(100_000, true, 16, false).unwrap();
    let hashes: Vec<Digest> = (0..256u64).map(|i| HashAlgo::Sha256.digest(&i.to_le_bytes())).collect();
    let mut ids = Vec::new();
    pool.get_new_blocks(256, &mut ids).unwrap();
    pool.cache_full_blocks(&ids, 0, 256, &hashes, 16, 0, None, 0).unwrap();
    let mut g = c.benchmark_group("pool");
    g.throughput(Throughput::Elements(256));
    g.bench_function("lookup_hit_256", |b| {
        b.iter(|| {
            let mut n = 0u32;
            for h in &hashes {
                n += pool.lookup(black_box(h), 0).unwrap_or(0);
            }
            black_box(n)
        })
    });
    g.bench_function("alloc_free_128", |b| {
        let mut out = Vec::with_capacity(128);
        b.iter(|| {
            out.clear();
            pool.get_new_blocks(128, &mut out).unwrap();
            out.reverse();
            pool.free_blocks(&out, false).unwrap();
        })
    });
    g.finish();
}

criterion_group!(pool_benches, bench_pool);
criterion_main!(benches, pool_benches);
