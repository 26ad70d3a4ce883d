//! Criterion benchmarks of the fleet prefix index (pure Rust, no Python): ingest of msgpack
//! `KVEventBatch` payloads and a 64-block lookup across 64 instances.

use _core::index::PrefixIndex;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

mod common;
use common::splitmix64;

fn key(out: &mut Vec<u8>, k: &str) {
    out.push(0xa0 | k.len() as u8);
    out.extend_from_slice(k.as_bytes());
}

fn hashes(out: &mut Vec<u8>, hs: &[u64]) {
    out.push(0xdc);
    out.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    for h in hs {
        out.push(0xcf);
        out.extend_from_slice(&h.to_be_bytes());
    }
}

/// `[0.0, [BlockStored(stored, parent), BlockRemoved(removed)?]]` as msgspec encodes it.
fn payload(stored: &[u64], parent: Option<u64>, removed: &[u64]) -> Vec<u8> {
    let mut v = vec![0x92, 0xcb];
    v.extend_from_slice(&0f64.to_bits().to_be_bytes());
    v.push(if removed.is_empty() { 0x91 } else { 0x92 });
    v.push(0x88);
    key(&mut v, "type");
    key(&mut v, "BlockStored");
    key(&mut v, "block_hashes");
    hashes(&mut v, stored);
    key(&mut v, "parent_block_hash");
    match parent {
        Some(p) => {
            v.push(0xcf);
            v.extend_from_slice(&p.to_be_bytes());
        }
        None => v.push(0xc0),
    }
    key(&mut v, "token_ids");
    v.push(0x90);
    key(&mut v, "block_size");
    v.push(16);
    key(&mut v, "lora_id");
    v.push(0xc0);
    key(&mut v, "medium");
    key(&mut v, "GPU");
    key(&mut v, "lora_name");
    v.push(0xc0);
    if !removed.is_empty() {
        v.push(0x83);
        key(&mut v, "type");
        key(&mut v, "BlockRemoved");
        key(&mut v, "block_hashes");
        hashes(&mut v, removed);
        key(&mut v, "medium");
        key(&mut v, "GPU");
    }
    v
}

fn bench_index(c: &mut Criterion) {
    // 64 instances, 40 rounds: a 32-block chain each (8 shared blocks), 16 evictions
    let mut seed = 1u64;
    let mut next = || {
        seed += 1;
        splitmix64(seed)
    };
    let system: Vec<u64> = (0..8).map(|_| next()).collect();
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); 64];
    let mut stream = Vec::new();
    let mut events = 0u64;
    for _ in 0..40 {
        for (i, h) in held.iter_mut().enumerate() {
            let own: Vec<u64> = (0..24).map(|_| next()).collect();
            let mut chain = system.clone();
            chain.extend_from_slice(&own);
            let removed: Vec<u64> = if h.len() >= 64 { h.drain(..16).collect() } else { Vec::new() };
            events += 32 + removed.len() as u64;
            stream.push((format!("e{i}"), payload(&chain, None, &removed)));
            h.extend(own);
        }
    }
    let mut g = c.benchmark_group("index");
    g.throughput(Throughput::Elements(events));
    g.bench_function("ingest_payloads", |b| {
        b.iter(|| {
            let mut ix = PrefixIndex::new(Some(16), 0);
            for (name, p) in &stream {
                ix.apply_payload(name, p, 0).unwrap();
            }
            ix
        })
    });
    // lookup: instance i holds the first i+1 blocks of a 64-block chain and 2,000 of its own
    let chain: Vec<u64> = (0..64).map(|_| next()).collect();
    let mut ix = PrefixIndex::new(Some(16), 0);
    for i in 0..64 {
        let own: Vec<u64> = (0..2000).map(|_| next()).collect();
        ix.apply_payload(&format!("e{i}"), &payload(&chain[..i + 1], None, &[]), 0).unwrap();
        ix.apply_payload(&format!("e{i}"), &payload(&own, None, &[]), 0).unwrap();
    }
    let mut out = Vec::new();
    ix.match_dense(&chain, None, &mut out);
    assert_eq!(out, (1..=64).collect::<Vec<u32>>());
    g.throughput(Throughput::Elements(1));
    g.bench_function("match_64_blocks_64_instances", |b| {
        b.iter(|| {
            ix.match_dense(std::hint::black_box(&chain), None, &mut out);
            out[63]
        })
    });
    g.finish();
}

criterion_group!(index_benches, bench_index);
criterion_main!(index_benches);
