//! kvblock's `PrefixIndex` side by side with `smg-radix-tree` 0.1.0 (SGLang gateway) and
//! `dynamo-kv-router` 1.6.1's `RadixTree`, each through its public Rust API, on SMG's
//! pinned workload shape and its fragmented variant (see `workload.rs`).
//!
//! `kvblock-peers all [pinned|fragmented|both] [runs]`: for each shape and run, one child
//! process per index (clean RSS), then checks that the three gave the same answer to every
//! query (a digest per cell) and prints the table: ingest (M stream blocks/s, one thread),
//! RSS bytes per resident holder-block, p50 / p99 per query cell (median over passes).
//! `kvblock-peers <kvblock|smg|dynamo> <pinned|fragmented>` runs one side and prints
//! `RESULT` lines. `PEERS_SCALE=k` multiplies the shape's blocks by k; with one side,
//! `PEERS_DEBUG=1` adds ns per block of deep queries and `PEERS_LOOP=n` ns per query of
//! the shared cells looped `n` times (`LOOP` lines: the walk with its data in cache).

mod workload;

use std::collections::HashMap;
use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use workload::{Cell, Op, Shape, FRAGMENTED, PINNED};

const PASSES: usize = 7;

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// One index under test. `query` is the timed call; `answer` reads its result afterwards
/// as sorted (holder, depth) pairs.
trait Side {
    fn store(&mut self, holder: usize, parent: Option<u64>, blocks: &[(u64, u64)]);
    fn remove(&mut self, holder: usize, keys: &[u64]);
    /// Everything a query needs prepared outside the timed region: every side gets its own
    /// fresh copy of the cell's queries here (Dynamo takes its query by value, so its copies
    /// must be made here; the others get the same, so that no side reads its query from
    /// memory the others find in cache).
    fn prepare(&mut self, _cell: &Cell) {}
    fn query(&mut self, cell: &Cell, i: usize);
    fn answer(&self) -> Vec<(u32, u32)>;
    fn debug(&self) {}
}

// -- kvblock -------------------------------------------------------------------------------

struct Kv {
    ix: _core::index::PrefixIndex,
    names: Vec<String>,
    keys: Vec<u64>,
    hits: Vec<(u32, u32)>,
    prepared: Vec<Vec<u64>>,
}

impl Kv {
    fn new(holders: usize) -> Self {
        let mut ix = _core::index::PrefixIndex::new(None, 0);
        let names: Vec<String> = (0..holders).map(|h| format!("holder-{h}")).collect();
        for (h, n) in names.iter().enumerate() {
            assert_eq!(ix.add_instance(n).unwrap() as usize, h);
        }
        Kv { ix, names, keys: Vec::new(), hits: Vec::new(), prepared: Vec::new() }
    }
}

impl Side for Kv {
    fn store(&mut self, holder: usize, parent: Option<u64>, blocks: &[(u64, u64)]) {
        self.keys.clear();
        self.keys.extend(blocks.iter().map(|b| b.0));
        self.ix.store(&self.names[holder], &self.keys, parent, None).unwrap();
    }
    fn remove(&mut self, holder: usize, keys: &[u64]) {
        self.ix.remove(&self.names[holder], keys, None).unwrap();
    }
    fn prepare(&mut self, cell: &Cell) {
        self.prepared = cell.keys.clone();
    }
    fn query(&mut self, _cell: &Cell, i: usize) {
        // the hits only, as SMG's `overlap` and Dynamo's `find_matches` give them
        self.ix.match_sparse(&self.prepared[i], None, &mut self.hits);
        black_box(&self.hits);
    }
    fn debug(&self) {
        eprintln!(
            "DEBUG nodes {} pairs {} memory {}",
            self.ix.num_nodes(),
            self.ix.num_pairs(),
            self.ix.memory_bytes()
        );
    }
    fn answer(&self) -> Vec<(u32, u32)> {
        let mut v = self.hits.clone();
        v.sort_unstable();
        v
    }
}

// -- SMG -----------------------------------------------------------------------------------

struct Smg {
    tree: radix_tree::RadixTree,
    ids: Vec<radix_tree::HolderId>,
    back: HashMap<radix_tree::HolderId, u32>,
    scratch: radix_tree::OverlapScratch,
    out: Vec<radix_tree::Overlap>,
    prepared: Vec<Vec<u64>>,
}

impl Smg {
    fn new(holders: usize) -> Self {
        let mut tree = radix_tree::RadixTree::new(radix_tree::Config::default());
        let ids: Vec<_> = (0..holders).map(|h| tree.create_holder(&format!("holder-{h}"))).collect();
        let back = ids.iter().enumerate().map(|(h, id)| (*id, h as u32)).collect();
        Smg { tree, ids, back, scratch: Default::default(), out: Vec::new(), prepared: Vec::new() }
    }
}

impl Side for Smg {
    fn store(&mut self, holder: usize, parent: Option<u64>, blocks: &[(u64, u64)]) {
        match self.tree.store(self.ids[holder], parent, blocks) {
            Ok(_) => {}
            Err(radix_tree::StoreError::ParentNotFound) => {
                self.tree.store(self.ids[holder], None, blocks).unwrap();
            }
            Err(e) => panic!("smg store: {e:?}"),
        }
    }
    fn remove(&mut self, holder: usize, keys: &[u64]) {
        self.tree.remove(self.ids[holder], keys);
    }
    fn prepare(&mut self, cell: &Cell) {
        self.prepared = cell.contents.clone();
    }
    fn query(&mut self, _cell: &Cell, i: usize) {
        self.tree.overlap(&self.prepared[i], &mut self.scratch, &mut self.out);
        black_box(&self.out);
    }
    fn answer(&self) -> Vec<(u32, u32)> {
        let mut v: Vec<(u32, u32)> =
            self.out.iter().filter(|o| o.depth > 0).map(|o| (self.back[&o.holder], o.depth)).collect();
        v.sort_unstable();
        v
    }
}

// -- Dynamo --------------------------------------------------------------------------------

mod dyn_side {
    use dynamo_kv_router::protocols::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
        KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
    };
    use dynamo_kv_router::RadixTree;

    pub struct Dynamo {
        tree: RadixTree,
        event_id: u64,
        prepared: Vec<Vec<LocalBlockHash>>,
        out: OverlapScores,
    }

    impl Dynamo {
        pub fn new() -> Self {
            Dynamo { tree: RadixTree::new(), event_id: 0, prepared: Vec::new(), out: OverlapScores::new() }
        }
    }

    impl super::Side for Dynamo {
        fn store(&mut self, holder: usize, parent: Option<u64>, blocks: &[(u64, u64)]) {
            self.event_id += 1;
            let data = KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: blocks
                    .iter()
                    .map(|&(k, c)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(k),
                        tokens_hash: LocalBlockHash(c),
                        mm_extra_info: None,
                    })
                    .collect(),
            });
            let ev = KvCacheEvent { event_id: self.event_id, data, dp_rank: 0 };
            self.tree.apply_event(RouterEvent::new(holder as u64, ev)).expect("dynamo store");
        }
        fn remove(&mut self, holder: usize, keys: &[u64]) {
            self.event_id += 1;
            let data = KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: keys.iter().map(|&k| ExternalSequenceBlockHash(k)).collect(),
            });
            let ev = KvCacheEvent { event_id: self.event_id, data, dp_rank: 0 };
            let _ = self.tree.apply_event(RouterEvent::new(holder as u64, ev));
        }
        fn prepare(&mut self, cell: &super::Cell) {
            self.prepared = cell.contents.iter().map(|q| q.iter().map(|&c| LocalBlockHash(c)).collect()).collect();
        }
        fn query(&mut self, _cell: &super::Cell, i: usize) {
            let q = std::mem::take(&mut self.prepared[i]);
            self.out = self.tree.find_matches(q, false);
        }
        fn answer(&self) -> Vec<(u32, u32)> {
            let mut v: Vec<(u32, u32)> =
                self.out.scores.iter().filter(|(_, d)| **d > 0).map(|(w, d)| (w.worker_id as u32, *d)).collect();
            v.sort_unstable();
            v
        }
    }
}

fn shape_of(name: &str) -> Shape {
    let mut s = match name {
        "pinned" => PINNED,
        "fragmented" => FRAGMENTED,
        _ => panic!("unknown shape {name:?} (pinned | fragmented)"),
    };
    if let Ok(k) = std::env::var("PEERS_SCALE") {
        let k: u64 = k.parse().expect("PEERS_SCALE: an integer");
        s.blocks *= k;
    }
    s
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn run_side(side: &str, shape_name: &str) {
    let shape = shape_of(shape_name);
    let mut w = workload::generate(&shape);
    let cells = workload::cells(&mut w, &shape);
    let rss0 = rss_bytes();
    let mut s: Box<dyn Side> = match side {
        "kvblock" => Box::new(Kv::new(shape.holders)),
        "smg" => Box::new(Smg::new(shape.holders)),
        "dynamo" => Box::new(dyn_side::Dynamo::new()),
        _ => panic!("unknown side {side:?}"),
    };
    let t = Instant::now();
    for op in &w.ops {
        match op {
            Op::Store { holder, parent, blocks } => s.store(*holder, *parent, blocks),
            Op::Remove { holder, keys } => s.remove(*holder, keys),
        }
    }
    let fill = t.elapsed().as_secs_f64();
    if std::env::var_os("PEERS_DEBUG").is_some() {
        s.debug();
        let n: usize = w.ops.iter().filter(|o| matches!(o, Op::Store { .. })).count();
        eprintln!("DEBUG ops {} stores {n} stream_blocks {}", w.ops.len(), w.stream_blocks);
    }
    let rss1 = rss_bytes();
    println!("RESULT resident {}", w.resident);
    println!("RESULT ingest {:.3}", w.stream_blocks as f64 / fill / 1e6);
    println!("RESULT bytes {:.2}", rss1.saturating_sub(rss0) as f64 / w.resident as f64);
    // the answers, once (untimed)
    for (ci, cell) in cells.iter().enumerate() {
        s.prepare(cell);
        let mut digest = 0xcbf2_9ce4_8422_2325u64;
        let mut pairs = 0usize;
        for i in 0..cell.keys.len() {
            s.query(cell, i);
            let a = s.answer();
            pairs += a.len();
            for (h, d) in a {
                digest = (digest ^ ((h as u64) << 32 | d as u64)).wrapping_mul(0x100_0000_01b3);
            }
            digest = (digest ^ 0xffff).wrapping_mul(0x100_0000_01b3);
        }
        println!("RESULT answers{ci} {digest:016x}/{pairs}");
    }
    // timed passes, cells interleaved; per cell the median over passes of p50 and p99
    let mut p50s = vec![Vec::new(); cells.len()];
    let mut p99s = vec![Vec::new(); cells.len()];
    let mut lat = Vec::new();
    for _ in 0..PASSES {
        for (ci, cell) in cells.iter().enumerate() {
            s.prepare(cell);
            lat.clear();
            for i in 0..cell.keys.len() {
                let t = Instant::now();
                s.query(cell, i);
                lat.push(t.elapsed().as_nanos() as u64);
            }
            lat.sort_unstable();
            p50s[ci].push(pct(&lat, 0.5));
            p99s[ci].push(pct(&lat, 0.99));
        }
    }
    if let Some(n) = std::env::var("PEERS_LOOP").ok().and_then(|x| x.parse::<usize>().ok()) {
        // the 8- and 64-holder and depth-78 cells, each cell's queries n times over: the
        // walk's cost with its data in cache (and a steady loop for `perf record`)
        for cell in &cells[1..4] {
            s.prepare(cell);
            let t = Instant::now();
            for _ in 0..n {
                for i in 0..cell.keys.len() {
                    s.query(cell, i);
                }
            }
            eprintln!(
                "LOOP {}: {:.0} ns/query",
                cell.name,
                t.elapsed().as_nanos() as f64 / (n * cell.keys.len()) as f64
            );
        }
    }
    if std::env::var_os("PEERS_DEBUG").is_some() {
        // ns per block of the deep queries (>= 300 blocks), per cell
        for cell in &cells {
            s.prepare(cell);
            let (mut ns, mut blocks, mut hits) = (0u128, 0usize, 0usize);
            for i in 0..cell.keys.len() {
                let t = Instant::now();
                s.query(cell, i);
                let e = t.elapsed().as_nanos();
                if cell.keys[i].len() >= 300 {
                    ns += e;
                    blocks += cell.keys[i].len();
                    hits += s.answer().len();
                }
            }
            let t = Instant::now();
            for i in 0..cell.keys.len() {
                s.query(cell, i);
            }
            println!(
                "DEBUG {}: {:.0} ns/query back to back",
                cell.name,
                t.elapsed().as_nanos() as f64 / cell.keys.len() as f64
            );
            println!(
                "DEBUG {}: {} deep blocks, {:.1} ns/block, {hits} holder hits",
                cell.name,
                blocks,
                ns as f64 / blocks.max(1) as f64
            );
        }
    }
    for ci in 0..cells.len() {
        println!(
            "RESULT cell{ci} {} {} {} {}",
            median(p50s[ci].clone()),
            median(p99s[ci].clone()),
            cells[ci].keys.len(),
            cells[ci].name.replace(' ', "_")
        );
    }
    // skip the (slow, irrelevant) teardown of the peers' trees
    std::process::exit(0);
}

fn child(side: &str, shape: &str) -> HashMap<String, String> {
    let exe = std::env::current_exe().expect("own path");
    let out = Command::new(exe).args([side, shape]).output().expect("run a side");
    assert!(out.status.success(), "{side} {shape}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn us(ns: &str) -> String {
    let v: f64 = ns.parse().unwrap_or(0.0);
    format!("{:.2}", v / 1000.0)
}

fn run_all(shapes: &[&str], runs: usize) {
    let sides = ["kvblock", "smg", "dynamo"];
    for shape in shapes {
        for run in 0..runs {
            let results: Vec<_> = sides.iter().map(|s| child(s, shape)).collect();
            let agree = (0..5).all(|c| {
                let k = format!("answers{c}");
                results.iter().all(|r| r.get(&k) == results[0].get(&k))
            });
            println!("\n### {shape}, run {}: {} resident holder-blocks", run + 1, results[0]["resident"]);
            println!("answers agree: {}", if agree { "yes (every query, every cell)" } else { "NO" });
            if !agree {
                for c in 0..5 {
                    let k = format!("answers{c}");
                    println!("  cell {c}: {:?}", results.iter().map(|r| r[&k].clone()).collect::<Vec<_>>());
                }
            }
            println!("\n| | kvblock | smg-radix-tree 0.1.0 | dynamo-kv-router 1.6.1 |\n|---|---:|---:|---:|");
            let row = |label: &str, f: &dyn Fn(&HashMap<String, String>) -> String| {
                let cols: Vec<String> = results.iter().map(f).collect();
                println!("| {label} | {} |", cols.join(" | "));
            };
            row("ingest (M blocks/s)", &|r| r["ingest"].clone());
            row("RSS bytes / holder-block", &|r| r["bytes"].clone());
            for c in 0..5 {
                let name = results[0][&format!("cell{c}")].split(' ').nth(3).unwrap_or("").replace('_', " ");
                row(&format!("{name} p50 / p99 (µs)"), &|r| {
                    let v: Vec<&str> = r[&format!("cell{c}")].split(' ').collect();
                    format!("{} / {}", us(v[0]), us(v[1]))
                });
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("all") | None => {
            let shapes: Vec<&str> = match args.get(1).map(String::as_str) {
                Some("pinned") => vec!["pinned"],
                Some("fragmented") => vec!["fragmented"],
                _ => vec!["pinned", "fragmented"],
            };
            let runs = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(1);
            run_all(&shapes, runs);
        }
        Some(side) => run_side(side, args.get(1).map(String::as_str).unwrap_or("pinned")),
    }
}
