//! The SGLang gateway's (SMG, `smg-radix-tree` 0.1.0) pinned benchmark workload, generated
//! from its published parameters (`tests/pinned_bench.rs`, section 11 constants): written
//! here from the description, same seed, same draw order, so the stream has its shape.
//!
//! Families of blocks shared by 1, 8 or 64 holders (50 / 35 / 15% of the holder-blocks),
//! shared prefixes log-uniform in 8..=512 blocks, each holder's divergent tail 4..=64
//! blocks, stores in batches of 8, 5% of batches re-published, and interior holes: one hole
//! in a fifth of the (family, holder) chains (`pinned`) or 2% of every chain's interior
//! blocks (`fragmented`). Holders' scripts are interleaved at random, each in its own order.

/// SplitMix64 (the generator SMG's bench draws from).
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn chance(&mut self, pct: u64) -> bool {
        self.next_u64() % 100 < pct
    }

    fn log_uniform(&mut self, lo: u32, hi: u32) -> u32 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        (a + u * (b - a)).exp().round() as u32
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Holes {
    /// This percent of chains lose one interior block.
    Chains(u64),
    /// Every chain loses this percent of its interior blocks.
    Share(u64),
}

#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub name: &'static str,
    pub holders: usize,
    /// Target stream blocks (holder-blocks of the shared prefixes: tails come on top).
    pub blocks: u64,
    pub mix: [(usize, u64); 3],
    pub shared: (u32, u32),
    pub tail: (u32, u32),
    pub dup_pct: u64,
    pub holes: Holes,
}

pub const PINNED: Shape = Shape {
    name: "pinned",
    holders: 256,
    blocks: 10_000_000,
    mix: [(1, 50), (8, 35), (64, 15)],
    shared: (8, 512),
    tail: (4, 64),
    dup_pct: 5,
    holes: Holes::Chains(20),
};

pub const FRAGMENTED: Shape = Shape { name: "fragmented", holes: Holes::Share(2), ..PINNED };

pub const BATCH: usize = 8;
pub const SEED: u64 = 20260901;
/// The gate cell's depth (its holders: 64).
pub const GATE_DEPTH: usize = 78;

/// A block: (chained key, the vLLM-style block hash; content, the per-block token hash).
pub type Block = (u64, u64);

pub struct Family {
    pub blocks: Vec<Block>,
    pub holders: Vec<usize>,
}

#[derive(Clone, Debug)]
pub enum Op {
    Store { holder: usize, parent: Option<u64>, blocks: Vec<Block> },
    Remove { holder: usize, keys: Vec<u64> },
}

pub struct Workload {
    pub families: Vec<Family>,
    pub ops: Vec<Op>,
    /// Holder-blocks stored minus those the holes removed.
    pub resident: u64,
    pub stream_blocks: u64,
    pub rng: Rng,
}

fn families(shape: &Shape, rng: &mut Rng) -> Vec<Family> {
    let mut out = Vec::new();
    let mut gate_pending = true;
    for &(h, pct) in &shape.mix {
        let budget = shape.blocks * pct / 100;
        let mut used = 0u64;
        while used < budget {
            // the first 64-holder family is deep enough for the gate cell
            let len = if gate_pending && h == 64 {
                gate_pending = false;
                96
            } else {
                rng.log_uniform(shape.shared.0, shape.shared.1)
            };
            let mut blocks: Vec<Block> = Vec::with_capacity(len as usize);
            for i in 0..len {
                let content = rng.next_u64() | 1;
                let key = match i {
                    0 => content,
                    _ => (blocks[i as usize - 1].0 ^ content.rotate_left(17)).wrapping_mul(0x2545_F491_4F6C_DD1D) | 1,
                };
                blocks.push((key, content));
            }
            let base = rng.below(shape.holders);
            let mut holders: Vec<usize> = (0..h).map(|k| (base + k * 7) % shape.holders).collect();
            holders.sort_unstable();
            holders.dedup();
            used += len as u64 * holders.len() as u64;
            out.push(Family { blocks, holders });
        }
    }
    out
}

pub fn generate(shape: &Shape) -> Workload {
    let mut rng = Rng::new(SEED);
    let families = families(shape, &mut rng);
    let mut scripts: Vec<Vec<Op>> = vec![Vec::new(); shape.holders];
    let (mut stored, mut removed) = (0u64, 0u64);
    for fam in &families {
        for &holder in &fam.holders {
            let mut stores = Vec::new();
            let mut parent = None;
            for chunk in fam.blocks.chunks(BATCH) {
                stores.push(Op::Store { holder, parent, blocks: chunk.to_vec() });
                parent = chunk.last().map(|b| b.0);
            }
            let tail_len = shape.tail.0 + (rng.next_u64() % (shape.tail.1 - shape.tail.0 + 1) as u64) as u32;
            let mut prev = parent.unwrap_or(0);
            let mut tail = Vec::with_capacity(tail_len as usize);
            for _ in 0..tail_len {
                let content = rng.next_u64() | 1;
                let key =
                    (prev ^ content.rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(holder as u64)
                        | 1;
                tail.push((key, content));
                prev = key;
            }
            for chunk in tail.chunks(BATCH) {
                stores.push(Op::Store { holder, parent, blocks: chunk.to_vec() });
                parent = chunk.last().map(|b| b.0);
            }
            stored += (fam.blocks.len() + tail.len()) as u64;
            let dups: Vec<Op> = stores.iter().filter(|_| rng.chance(shape.dup_pct)).cloned().collect();
            let mut holes = None;
            let interior = fam.blocks.len().saturating_sub(2);
            if interior > 0 {
                let n = match shape.holes {
                    Holes::Chains(pct) => usize::from(rng.chance(pct)),
                    Holes::Share(pct) => {
                        let hundredths = pct * interior as u64;
                        (hundredths / 100) as usize + usize::from(rng.chance(hundredths % 100))
                    }
                }
                .min(interior);
                if n > 0 {
                    // n distinct interior positions (1..=interior), a partial shuffle
                    let mut pos: Vec<usize> = (1..=interior).collect();
                    let mut keys = Vec::with_capacity(n);
                    for v in 0..n {
                        let pick = v + rng.below(pos.len() - v);
                        pos.swap(v, pick);
                        keys.push(fam.blocks[pos[v]].0);
                    }
                    removed += n as u64;
                    holes = Some(Op::Remove { holder, keys });
                }
            }
            let script = &mut scripts[holder];
            script.extend(stores);
            script.extend(dups);
            script.extend(holes);
        }
    }
    // interleave the holders' scripts at random, each in order
    let mut cursor = vec![0usize; shape.holders];
    let mut live: Vec<usize> = (0..shape.holders).filter(|&h| !scripts[h].is_empty()).collect();
    let mut ops = Vec::with_capacity(scripts.iter().map(Vec::len).sum());
    while !live.is_empty() {
        let li = rng.below(live.len());
        let h = live[li];
        ops.push(std::mem::replace(&mut scripts[h][cursor[h]], Op::Remove { holder: h, keys: Vec::new() }));
        cursor[h] += 1;
        if cursor[h] == scripts[h].len() {
            live.swap_remove(li);
        }
    }
    let stream_blocks = ops
        .iter()
        .map(|op| match op {
            Op::Store { blocks, .. } => blocks.len() as u64,
            Op::Remove { keys, .. } => keys.len() as u64,
        })
        .sum();
    Workload { families, ops, resident: stored - removed, stream_blocks, rng }
}

/// One query cell: each query as (block keys, contents) of one family's prefix.
pub struct Cell {
    pub name: &'static str,
    pub keys: Vec<Vec<u64>>,
    pub contents: Vec<Vec<u64>>,
}

/// The query cells: a random-depth prefix of up to 2,000 families per sharing factor, the
/// depth-78 prefix of up to 2,000 64-holder families, and 1,000 random misses (1..=96 blocks).
pub fn cells(w: &mut Workload, shape: &Shape) -> Vec<Cell> {
    let mut out = Vec::new();
    let names = ["single holder", "8 holders", "64 holders"];
    for (i, &(h, _)) in shape.mix.iter().enumerate() {
        let mut c = Cell { name: names[i], keys: Vec::new(), contents: Vec::new() };
        for fam in w.families.iter().filter(|f| f.holders.len() == h).take(2000) {
            let d = 1 + w.rng.below(fam.blocks.len());
            c.keys.push(fam.blocks[..d].iter().map(|b| b.0).collect());
            c.contents.push(fam.blocks[..d].iter().map(|b| b.1).collect());
        }
        out.push(c);
    }
    let mut gate = Cell { name: "depth 78, 64 holders", keys: Vec::new(), contents: Vec::new() };
    for fam in w.families.iter().filter(|f| f.holders.len() == 64 && f.blocks.len() >= GATE_DEPTH).take(2000) {
        gate.keys.push(fam.blocks[..GATE_DEPTH].iter().map(|b| b.0).collect());
        gate.contents.push(fam.blocks[..GATE_DEPTH].iter().map(|b| b.1).collect());
    }
    out.push(gate);
    let mut miss = Cell { name: "miss", keys: Vec::new(), contents: Vec::new() };
    for _ in 0..1000 {
        let len = 1 + w.rng.below(96);
        let q: Vec<u64> = (0..len).map(|_| w.rng.next_u64() | 1).collect();
        miss.keys.push(q.clone());
        miss.contents.push(q);
    }
    out.push(miss);
    out
}
