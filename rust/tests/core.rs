//! Integration tests of the pure-Rust core against vLLM's golden vectors.

use _core::hashing::cbor;
use _core::hashing::pickle;
use _core::hashing::value::{Int, Value};
use _core::hashing::{BlockHasher, HashAlgo, ALGORITHM_NAMES};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn none_hash_golden() {
    let seed = Value::str(0, "vllm-none-hash");
    let want = [
        (HashAlgo::Sha256, "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"),
        (HashAlgo::Sha256Cbor, "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"),
    ];
    for (algo, h) in want {
        assert_eq!(hex(BlockHasher::new(algo).hash_value(&seed).unwrap().as_bytes()), h);
    }
    // PYTHONHASHSEED="0"
    let zero = Value::str(0, "0");
    assert_eq!(
        hex(BlockHasher::new(HashAlgo::Xxhash).hash_value(&zero).unwrap().as_bytes()),
        "6fb31cc38bba6066183f7f2104b9c051"
    );
    assert_eq!(
        hex(BlockHasher::new(HashAlgo::XxhashCbor).hash_value(&zero).unwrap().as_bytes()),
        "1ebe36576dcb573f26b99533a20aaeca"
    );
}

#[test]
fn plain_chain_golden() {
    let tokens: Vec<i64> = (0..32).collect();
    let cases = [
        (
            HashAlgo::Sha256,
            "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
            [
                "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
                "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629",
            ],
        ),
        (
            HashAlgo::Sha256Cbor,
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
            [
                "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
                "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
            ],
        ),
        (
            HashAlgo::Xxhash,
            "6fb31cc38bba6066183f7f2104b9c051",
            ["8ef953407c0da43eacbb3639ed2bff4d", "5a51cc5ac3a4b1f7d5efd012fb00201a"],
        ),
        (
            HashAlgo::XxhashCbor,
            "1ebe36576dcb573f26b99533a20aaeca",
            ["209f5d549fc07c8e39d823615ede61ce", "03888914ee75b87e89df867a21beb72b"],
        ),
    ];
    for (algo, root, want) in cases {
        let mut h = BlockHasher::new(algo);
        let got = h.hash_chain(0, &unhex(root), &tokens, 16, |_| None).unwrap();
        assert_eq!(got.iter().map(|d| hex(d.as_bytes())).collect::<Vec<_>>(), want, "{}", algo.name());
    }
    let mut h = BlockHasher::new(HashAlgo::Sha256);
    let ser = h.serialize_block(0, &unhex(cases[0].1), &tokens[..16], None).unwrap();
    assert_eq!(
        hex(ser),
        "8005954a000000000000004320066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d7119894284b004b014b024b034b044b054b064b074b084b094b0a4b0b4b0c4b0d4b0e4b0f74944e87942e"
    );
}

#[test]
fn multimodal_memo_golden() {
    // Vector C, block 1: (("mm","img-a",-13),("mm","img-b",12)) with one "mm" object.
    let mm = 11; // identity of the shared tag literal
    let extra = Value::tuple(
        1,
        vec![
            Value::tuple(2, vec![Value::str(mm, "mm"), Value::str(3, "img-a"), Value::Int(Int::Small(-13))]),
            Value::tuple(4, vec![Value::str(mm, "mm"), Value::str(5, "img-b"), Value::Int(Int::Small(12))]),
        ],
    );
    let tokens: Vec<i64> = [vec![1; 3], vec![9; 20], vec![2; 5], vec![9; 10], vec![3; 10]].concat();
    let e0 = Value::tuple(
        6,
        vec![Value::tuple(7, vec![Value::str(mm, "mm"), Value::str(3, "img-a"), Value::Int(Int::Small(3))])],
    );
    let e2 = Value::tuple(
        8,
        vec![Value::tuple(9, vec![Value::str(mm, "mm"), Value::str(5, "img-b"), Value::Int(Int::Small(-4))])],
    );
    let extras = [e0, extra, e2];
    let root = unhex("066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198");
    let got = BlockHasher::new(HashAlgo::Sha256).hash_chain(0, &root, &tokens, 16, |i| Some(&extras[i])).unwrap();
    assert_eq!(hex(got[1].as_bytes()), "b72b7dea40b17fedfefb4a3096ee191d1fa763269dde765ddca4eda1efbd7d49");
    assert_eq!(hex(got[2].as_bytes()), "f70a6a957fb3d20a71ed3a3cfb1b6e67a45cb56cfbb0efd980d385a8acf0da14");
}

#[test]
fn int_encodings() {
    // (value, pickle.dumps(value, 5), cbor2.dumps(value)) from CPython 3.11 / cbor2 6.3
    let cases: [(i64, &str, &str); 7] = [
        (0, "80054b002e", "00"),
        (255, "80054bff2e", "18ff"),
        (256, "80059504000000000000004d00012e", "190100"),
        (65536, "80059506000000000000004a000001002e", "1a00010000"),
        (-1, "80059506000000000000004affffffff2e", "20"),
        (1 << 31, "80059508000000000000008a0500000080002e", "1a80000000"),
        (-(1 << 39), "80059508000000000000008a0500000000802e", "3b0000007fffffffff"),
    ];
    for (v, p, c) in cases {
        assert_eq!(hex(&pickle::dumps(&Value::Int(Int::Small(v)))), p, "pickle {v}");
        let mut out = Vec::new();
        cbor::put_i64(&mut out, v);
        assert_eq!(hex(&out), c, "cbor {v}");
    }
    // 2**64 and -(2**64) - 1 need bignum tags in CBOR
    let two64 = Int::from_le_signed(&[0, 0, 0, 0, 0, 0, 0, 0, 1]);
    assert_eq!(hex(&cbor::dumps(&Value::Int(two64)).unwrap()), "c249010000000000000000");
    let m = Int::from_le_signed(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]);
    assert_eq!(hex(&cbor::dumps(&Value::Int(m)).unwrap()), "c349010000000000000000");
}

#[test]
fn algorithm_names() {
    for n in ALGORITHM_NAMES {
        assert_eq!(HashAlgo::from_name(n).unwrap().name(), n);
    }
    let e = HashAlgo::from_name("md5").unwrap_err().to_string();
    assert!(e.contains("sha256, sha256_cbor, xxhash, xxhash_cbor"), "{e}");
    assert!(BlockHasher::new(HashAlgo::Sha256).hash_chain(0, &[], &[1i64], 0, |_| None).is_err());
}

mod pool_and_manager {
    use _core::hashing::{BlockHasher, Digest, HashAlgo};
    use _core::manager::spec::{Caller, GroupSpec, Kind, ManagerConfig};
    use _core::manager::{AllocArgs, KVCacheManager, RequestView};
    use _core::pool::block_pool::BlockPool;

    fn hashes(tokens: &[i64], bs: usize) -> Vec<Digest> {
        BlockHasher::new(HashAlgo::Sha256).hash_chain(0, &[7u8; 32], tokens, bs, |_| None).unwrap()
    }

    fn group(kind: Kind, block_size: usize, class: u32) -> GroupSpec {
        GroupSpec {
            kind,
            block_size,
            prefix_cacheable: true,
            dcp_sharded: true,
            is_eagle_group: false,
            zeroed: true,
            spec_class: class,
        }
    }

    fn config(groups: Vec<GroupSpec>, num_blocks: usize, h: usize) -> ManagerConfig {
        let sched = _core::manager::spec::lcm_of(groups.iter().map(|g| g.block_size));
        ManagerConfig {
            scheduler_block_size: sched,
            ..ManagerConfig::new(groups, num_blocks, 4096, h, _core::manager::spec::Caller::Kvblock)
        }
    }

    fn one_group(block_size: usize, num_blocks: usize) -> (KVCacheManager, BlockPool) {
        let cfg = config(vec![group(Kind::FullAttention, block_size, 0)], num_blocks, block_size);
        (KVCacheManager::new(&cfg).unwrap(), BlockPool::new(num_blocks, true, block_size, false).unwrap())
    }

    /// Admit `tokens` as request `id`: the hit blocks and the new blocks per group.
    fn admit(
        m: &mut KVCacheManager,
        p: &mut BlockPool,
        id: &str,
        tokens: &[i64],
        h: usize,
    ) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
        let hs = hashes(tokens, h);
        let (hit, n, _) = m.get_computed_blocks(p, true, tokens.len(), &hs, None, None, true).unwrap();
        let req = RequestView {
            request_id: id,
            num_tokens: tokens.len(),
            num_prompt_tokens: tokens.len(),
            ..Default::default()
        };
        let has_hit = hit.iter().any(|g| !g.is_empty());
        let args = AllocArgs {
            num_new_tokens: tokens.len() - n,
            num_new_computed_tokens: n,
            new_computed: if has_hit { Some(&hit) } else { None },
            has_scheduled_reqs: true,
            ..Default::default()
        };
        let new = m.allocate_slots(p, &req, &hs, &args).unwrap().unwrap();
        (hit, new)
    }

    #[test]
    fn release_rules_decide_032s_mamba_caching_and_eagle_drops() {
        use _core::manager::release::ReleaseRules;
        use _core::manager::spec::MambaMode;
        let mamba = Kind::Mamba {
            mode: MambaMode::None,
            num_speculative_blocks: 0,
            num_prefill_checkpoint_blocks: 0,
            prefill_checkpoint_alignment: None,
        };
        let groups = vec![group(Kind::FullAttention, 4, 0), group(mamba, 4, 1)];
        // 0.33's rule (the default): Mamba prefix caching needs "align"
        assert!(KVCacheManager::new(&config(groups.clone(), 16, 4)).is_err());
        // 0.32's: a "none" group caches too
        let rules = ReleaseRules { mamba_none_mode_caches: true, ..ReleaseRules::default() };
        assert!(KVCacheManager::new(&ManagerConfig { rules, ..config(groups.clone(), 16, 4) }).is_ok());
        // an EAGLE-flagged group without use_eagle drops its EAGLE block on 0.32 only
        let mut flagged = vec![group(Kind::FullAttention, 4, 0), group(Kind::FullAttention, 4, 0)];
        flagged[1].is_eagle_group = true;
        let m = KVCacheManager::new(&config(flagged.clone(), 16, 4)).unwrap();
        assert_eq!(m.coord.drop_eagle_groups, vec![false, false]);
        let rules = ReleaseRules { eagle_groups_drop_always: true, ..ReleaseRules::default() };
        let m = KVCacheManager::new(&ManagerConfig { rules, ..config(flagged, 16, 4) }).unwrap();
        assert_eq!(m.coord.drop_eagle_groups, vec![false, true]);
    }

    #[test]
    fn spec_4_1_free_order() {
        // block size 16, 11 blocks: req0 = 48 common + 7, req1 = same 48 + 5 (spec §4.1)
        let (mut m, mut p) = one_group(16, 11);
        let common: Vec<i64> = (0..48).collect();
        let r0: Vec<i64> = common.iter().copied().chain(100..107).collect();
        let r1: Vec<i64> = common.iter().copied().chain(200..205).collect();
        assert_eq!(admit(&mut m, &mut p, "r0", &r0, 16), (vec![vec![]], vec![vec![1, 2, 3, 4]]));
        assert_eq!(admit(&mut m, &mut p, "r1", &r1, 16), (vec![vec![1, 2, 3]], vec![vec![5]]));
        m.free(&mut p, "r0").unwrap();
        m.free(&mut p, "r1").unwrap();
        assert_eq!(p.free_queue().collect::<Vec<_>>(), vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1]);
        p.check_invariants().unwrap();
        let mut out = Vec::new();
        p.get_new_blocks(10, &mut out).unwrap();
        assert_eq!(out, vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1]);
    }

    #[test]
    fn failed_allocation_changes_nothing() {
        // CASES C10: a hit block that is also the only free block cannot double as the new block
        let (mut m, mut p) = one_group(4, 4);
        admit(&mut m, &mut p, "a", &[1, 2, 3, 4], 4);
        m.free(&mut p, "a").unwrap();
        admit(&mut m, &mut p, "c", &(20..28).collect::<Vec<_>>(), 4);
        let b: Vec<i64> = vec![1, 2, 3, 4, 9];
        let h = hashes(&b, 4);
        let (hit, n, _) = m.get_computed_blocks(&p, true, 5, &h, None, None, true).unwrap();
        assert_eq!((hit.clone(), n), (vec![vec![1]], 4));
        let req = RequestView { request_id: "b", num_tokens: 5, num_prompt_tokens: 5, ..Default::default() };
        let args =
            AllocArgs { num_new_tokens: 1, num_new_computed_tokens: 4, new_computed: Some(&hit), ..Default::default() };
        assert_eq!(m.allocate_slots(&mut p, &req, &h, &args).unwrap(), None);
        assert_eq!((p.num_free_blocks(), p.ref_cnt(1).unwrap()), (1, 0));
        assert!(m.coord.get_blocks("b")[0].is_empty());
        p.check_invariants().unwrap();
    }

    #[test]
    fn external_tokens_past_the_pool_fail_before_any_change() {
        // issue 13: KVCacheManager(40, 4, max_model_len=64); a 12-token request, then a
        // 13-token one with the same prefix and 200 external tokens
        let cfg = ManagerConfig { max_model_len: 64, ..config(vec![group(Kind::FullAttention, 4, 0)], 40, 4) };
        let mut m = KVCacheManager::new(&cfg).unwrap();
        let mut p = BlockPool::new(40, true, 4, false).unwrap();
        admit(&mut m, &mut p, "a", &(0..12).collect::<Vec<_>>(), 4);
        m.free(&mut p, "a").unwrap();
        let b: Vec<i64> = (0..13).collect();
        let h = hashes(&b, 4);
        let (hit, n, _) = m.get_computed_blocks(&p, true, 13, &h, None, None, true).unwrap();
        assert_eq!(n, 12);
        let req = RequestView { request_id: "b", num_tokens: 13, num_prompt_tokens: 13, ..Default::default() };
        let args = AllocArgs {
            num_new_tokens: 1,
            num_new_computed_tokens: 12,
            new_computed: Some(&hit),
            num_external_computed_tokens: 200,
            ..Default::default()
        };
        let before = (p.num_free_blocks(), p.free_queue().collect::<Vec<_>>());
        assert!(m.allocate_slots(&mut p, &req, &h, &args).is_err());
        assert_eq!((p.num_free_blocks(), p.free_queue().collect::<Vec<_>>()), before);
        assert_eq!(p.num_free_blocks(), 39);
        assert!(p.reset_prefix_cache());
        p.check_invariants().unwrap();
    }

    #[test]
    fn hybrid_full_and_sliding_window_agree_on_a_hit() {
        // full attention + a 5-token window over 4-token blocks: a second request with the same
        // 12-token prefix hits 8 tokens in both groups (the last token is recomputed; the
        // window group needs only the block before the next token)
        let cfg = config(
            vec![
                group(Kind::FullAttention, 4, 0),
                group(Kind::SlidingWindow { window: 5, extra_retained_tokens: 0 }, 4, 1),
            ],
            30,
            4,
        );
        let mut m = KVCacheManager::new(&cfg).unwrap();
        let mut p = BlockPool::new(30, true, 4, false).unwrap();
        let t: Vec<i64> = (0..12).collect();
        let (_, new) = admit(&mut m, &mut p, "a", &t, 4);
        assert_eq!(new, vec![vec![1, 2, 3], vec![4, 5, 6]]);
        let (hit, new) = admit(&mut m, &mut p, "b", &t, 4);
        assert_eq!(hit, vec![vec![1, 2], vec![0, 5]]); // the window group pads with the null block
        assert_eq!(new, vec![vec![7], vec![8]]);
        m.free(&mut p, "a").unwrap();
        m.free(&mut p, "b").unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.num_free_blocks(), 29);
    }

    #[test]
    fn pool_bad_input_is_atomic() {
        let mut p = BlockPool::new(4, true, 4, false).unwrap();
        let mut out = Vec::new();
        assert!(p.get_new_blocks(5, &mut out).is_err());
        assert_eq!(p.free_queue().collect::<Vec<_>>(), vec![1, 2, 3]);
        p.get_new_blocks(2, &mut out).unwrap();
        // block 2 freed twice: the first decrement is rolled back
        assert!(p.free_blocks(&[1, 2, 2], false).is_err());
        assert_eq!((p.ref_cnt(1).unwrap(), p.ref_cnt(2).unwrap()), (1, 1));
        assert!(p.free_blocks(&[9], false).is_err());
        assert!(p.touch(&[0], false).is_err());
        p.check_invariants().unwrap();
        assert!(BlockPool::new(0, true, 4, false).is_err());
        assert!(KVCacheManager::new(&config(vec![group(Kind::FullAttention, 0, 0)], 4, 4)).is_err());
        // block sizes that do not divide the scheduler block size, an empty window
        assert!(KVCacheManager::new(&ManagerConfig {
            scheduler_block_size: 6,
            ..config(vec![group(Kind::FullAttention, 4, 0)], 4, 4)
        })
        .is_err());
        assert!(KVCacheManager::new(&config(
            vec![group(Kind::SlidingWindow { window: 0, extra_retained_tokens: 0 }, 4, 0)],
            4,
            4
        ))
        .is_err());
    }

    /// A manager of `groups` (4-token blocks) serving `caller`, and its 64-block pool, with
    /// request "a" admitted with a 10-token prompt (returned).
    fn admitted_decoder(groups: Vec<GroupSpec>, caller: Caller) -> (KVCacheManager, BlockPool, Vec<i64>) {
        let mut m = KVCacheManager::new(&ManagerConfig { caller, ..config(groups, 64, 4) }).unwrap();
        let mut p = BlockPool::new(64, true, 4, false).unwrap();
        let tokens: Vec<i64> = (0..10).collect();
        admit(&mut m, &mut p, "a", &tokens, 4);
        (m, p, tokens)
    }

    /// Request `id` in its decode steps: `computed` of `num_tokens` tokens, `prompt` of them
    /// the prompt.
    fn decode_view(id: &str, computed: usize, num_tokens: usize, prompt: usize) -> RequestView<'_> {
        RequestView {
            request_id: id,
            num_computed_tokens: computed,
            num_tokens,
            num_prompt_tokens: prompt,
            ..Default::default()
        }
    }

    /// What the fast paths may skip: the pool's observable state and the manager's.
    fn snapshot(m: &KVCacheManager, p: &BlockPool, id: &str) -> String {
        let mut free = Vec::new();
        let mut q = p.clone();
        q.get_new_blocks(q.num_free_blocks(), &mut free).unwrap();
        format!("{:?} {:?} {:?}", m, m.coord.get_blocks(id), free)
    }

    #[test]
    fn decode_fast_paths_change_nothing() {
        // allocate_is_noop / cache_is_noop (the binding's decode fast paths) hold only where the
        // full call returns no blocks and changes nothing; both happen, so the check bites
        let window = Kind::SlidingWindow { window: 8, extra_retained_tokens: 0 };
        for groups in
            [vec![group(Kind::FullAttention, 4, 0)], vec![group(Kind::FullAttention, 4, 0), group(window, 4, 1)]]
        {
            let (mut m, mut p, mut tokens) = admitted_decoder(groups, Caller::Kvblock);
            let prompt = tokens.len();
            let mut computed = prompt;
            tokens.push(1000);
            let (mut noops, mut full) = (0, 0);
            for step in 0..40 {
                let hs = hashes(&tokens, 4);
                let req = decode_view("a", computed, tokens.len(), prompt);
                let args = AllocArgs { num_new_tokens: 1, has_scheduled_reqs: true, ..Default::default() };
                let noop = m.allocate_is_noop("a", computed, tokens.len(), 0, &args);
                let before = snapshot(&m, &p, "a");
                let new = m.allocate_slots(&mut p, &req, &hs, &args).unwrap().unwrap();
                if noop {
                    assert!(new.iter().all(|g| g.is_empty()), "step {step}: a no-op allocated {new:?}");
                    assert_eq!(snapshot(&m, &p, "a"), before, "step {step}: a no-op allocate_slots changed state");
                    noops += 1;
                } else {
                    full += 1;
                }
                computed += 1;
                tokens.push(1001 + step);
                let hs = hashes(&tokens, 4);
                let req = RequestView { num_computed_tokens: computed, num_tokens: tokens.len(), ..req };
                let noop = m.cache_is_noop("a", computed);
                let before = snapshot(&m, &p, "a");
                m.cache_blocks(&mut p, &req, &hs, computed).unwrap();
                if noop {
                    assert_eq!(snapshot(&m, &p, "a"), before, "step {step}: a no-op cache_blocks changed state");
                }
            }
            // with 4-token blocks, one decode step in four allocates a block and one caches one
            assert!(noops >= 15 && full >= 15, "{noops} no-op and {full} full decode steps");
            m.free(&mut p, "a").unwrap();
            assert_eq!(p.num_free_blocks(), 63);
            p.check_invariants().unwrap();
        }
    }

    #[test]
    fn boundary_steps_do_what_the_full_call_does() {
        // boundary_step_at / allocate_growth_at (the binding's block-boundary path): where a
        // decode step's call only appends blocks, or only caches a newly full block, doing
        // just that leaves the manager and pool as the full allocate_slots does, with the same
        // blocks returned; both kinds happen, so the check bites
        use _core::manager::BoundaryStep;
        for lookahead in [0, 2] {
            let groups = vec![group(Kind::FullAttention, 4, 0), group(Kind::FullAttention, 4, 1)];
            let (mut m, mut p, mut tokens) = admitted_decoder(groups, Caller::Vllm);
            let prompt = tokens.len();
            let mut computed = prompt;
            let (mut grew, mut cached) = (0, 0);
            for step in 0..40 {
                let hs = hashes(&tokens, 4);
                let req = decode_view("a", computed, tokens.len(), prompt);
                let args = AllocArgs {
                    num_new_tokens: 1,
                    num_lookahead_tokens: lookahead,
                    has_scheduled_reqs: true,
                    ..Default::default()
                };
                let slot = m.coord.slot("a").unwrap();
                let boundary = m.boundary_step_at(slot, computed, tokens.len(), &args);
                let (mut m2, mut p2) = (m.clone(), p.clone());
                let new = m.allocate_slots(&mut p, &req, &hs, &args).unwrap().unwrap();
                match boundary {
                    Some(BoundaryStep::Grow(n)) => {
                        let got = m2.allocate_growth_at(&mut p2, slot, "a", computed, &args).unwrap();
                        assert_eq!(got, new, "step {step}: other blocks");
                        assert_eq!(got.iter().map(Vec::len).sum::<usize>(), n, "step {step}: miscounted");
                        grew += 1;
                    }
                    Some(BoundaryStep::Cache(to_cache)) => {
                        assert!(new.iter().all(|g| g.is_empty()), "step {step}: a caching call allocated {new:?}");
                        m2.cache_blocks(&mut p2, &req, &hs, to_cache).unwrap();
                        cached += 1;
                    }
                    None => {}
                }
                if boundary.is_some() {
                    assert_eq!(snapshot(&m2, &p2, "a"), snapshot(&m, &p, "a"), "step {step}: {boundary:?}");
                }
                computed += 1;
                tokens.push(1001 + step);
                if step % 3 != 2 {
                    // else the next call caches the block that filled
                    let hs = hashes(&tokens, 4);
                    let req = RequestView { num_computed_tokens: computed, num_tokens: tokens.len(), ..req };
                    m.cache_blocks(&mut p, &req, &hs, computed).unwrap();
                }
            }
            assert!(
                grew >= 3 && (cached > 0) == (lookahead > 0),
                "lookahead {lookahead}: {grew} grew, {cached} cached"
            );
            p.check_invariants().unwrap();
            // kvblock's own API checks each call in full: the path never answers for it (a
            // call that appends one block for vLLM's manager)
            let args = AllocArgs { num_new_tokens: 3, has_scheduled_reqs: true, ..Default::default() };
            for (caller, answer) in [(Caller::Vllm, Some(BoundaryStep::Grow(1))), (Caller::Kvblock, None)] {
                let (k, _, tokens) = admitted_decoder(vec![group(Kind::FullAttention, 4, 0)], caller);
                let slot = k.coord.slot("a").unwrap();
                assert_eq!(k.boundary_step_at(slot, tokens.len(), tokens.len() + 1, &args), answer);
            }
        }
    }
}

mod plain_blocks {
    //! The plain-block fast path (no extra keys, i64 tokens) against the general serializers.
    use super::*;
    use proptest::prelude::*;

    fn token() -> impl Strategy<Value = i64> {
        prop_oneof![0i64..24, 0i64..256, 0i64..65536, 0i64..(1 << 31), any::<i64>(), -(1i64 << 31)..0]
    }

    /// The digest of `(parent, tuple(tokens), None)` serialized as a general [`Value`].
    fn general(algo: HashAlgo, parent: &[u8], tokens: &[i64]) -> Vec<u8> {
        let v = Value::tuple(
            0,
            vec![
                Value::bytes(0, parent),
                Value::tuple(0, tokens.iter().map(|&t| Value::Int(Int::Small(t))).collect()),
                Value::None,
            ],
        );
        let ser = if algo.uses_cbor() { cbor::dumps(&v).unwrap() } else { pickle::dumps(&v) };
        algo.digest(&ser).as_bytes().to_vec()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn chain_matches_general_serialization(
            parent in proptest::collection::vec(any::<u8>(), 0..300),
            tokens in proptest::collection::vec(token(), 0..70),
            bs in prop_oneof![Just(1usize), Just(3), Just(4), Just(8), Just(16), Just(17)],
        ) {
            for algo in [HashAlgo::Sha256, HashAlgo::Sha256Cbor, HashAlgo::Xxhash, HashAlgo::XxhashCbor] {
                let got = BlockHasher::new(algo).hash_chain(0, &parent, &tokens, bs, |_| None).unwrap();
                let mut p = parent.clone();
                for (i, block) in tokens.chunks_exact(bs).enumerate() {
                    let want = general(algo, &p, block);
                    prop_assert_eq!(got[i].as_bytes(), &want[..], "{} block {}", algo.name(), i);
                    p = want;
                }
                prop_assert_eq!(got.len(), tokens.len() / bs);
            }
        }
    }

    #[test]
    fn scalar_and_vector_encoders_agree() {
        // KVBLOCK_NO_SIMD is read once per process; this checks the fast path on whichever
        // encoder this CPU uses against the general one on every width boundary.
        let edges: Vec<i64> =
            vec![0, 23, 24, 255, 256, 65535, 65536, (1 << 31) - 1, 1 << 31, -1, -(1 << 31), i64::MAX, i64::MIN];
        let tokens: Vec<i64> = edges.iter().cycle().take(16 * 13).copied().collect();
        for algo in [HashAlgo::Sha256, HashAlgo::Sha256Cbor, HashAlgo::Xxhash, HashAlgo::XxhashCbor] {
            let got = BlockHasher::new(algo).hash_chain(0, &[7u8; 32], &tokens, 16, |_| None).unwrap();
            let mut p = vec![7u8; 32];
            for (i, block) in tokens.chunks_exact(16).enumerate() {
                let want = general(algo, &p, block);
                assert_eq!(got[i].as_bytes(), &want[..], "{} block {i}", algo.name());
                p = want;
            }
        }
    }
}

mod digest_memo {
    use _core::hashing::digest_memo::DigestMemo;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn exact_hits_only() {
        let mut m: DigestMemo<u32> = DigestMemo::new(8, 4).unwrap();
        assert_eq!(m.capacity(), 8);
        let parent = [7u8; 32];
        assert_eq!(m.get(&parent, &[1, 2, 3, 4]), None);
        assert_eq!(m.insert(&parent, &[1, 2, 3, 4], 10), None);
        assert_eq!(m.get(&parent, &[1, 2, 3, 4]), Some(&10));
        // one token, one parent byte or the parent's length differs: a miss
        assert_eq!(m.get(&parent, &[1, 2, 3, 5]), None);
        let mut other = parent;
        other[31] ^= 1;
        assert_eq!(m.get(&other, &[1, 2, 3, 4]), None);
        assert_eq!(m.get(&parent[..16], &[1, 2, 3, 4]), None);
        // negative token ids are keyed by value too
        assert_eq!(m.insert(&parent, &[-1, 0, 1, i64::MIN], 11), None);
        assert_eq!(m.get(&parent, &[-1, 0, 1, i64::MIN]), Some(&11));
        assert_eq!(m.hits(), 2);
        assert_eq!(m.stores(), 2);
    }

    #[test]
    fn nothing_is_allocated_until_the_first_offer() {
        // a fleet replay builds one hasher per engine: an engine that never offers a block
        // must not pay for 16384 slots
        let mut m: DigestMemo<u32> = DigestMemo::new(16384, 16).unwrap();
        assert_eq!((m.capacity(), m.allocated_bytes(), m.len()), (16384, 0, 0));
        let parent = [3u8; 32];
        let tokens: Vec<i64> = (0..16).collect();
        assert_eq!(m.get(&parent, &tokens), None);
        assert_eq!(m.allocated_bytes(), 0);
        assert_eq!(m.offer(&parent, &tokens, 1), Some(1)); // first sighting: noted, not kept
        assert!(m.allocated_bytes() >= 16384 * (16 + 5) * 8);
        assert_eq!(m.offer(&parent, &tokens, 1), None); // second: kept
        assert_eq!(m.get(&parent, &tokens), Some(&1));
        let mut off: DigestMemo<u32> = DigestMemo::new(0, 16).unwrap();
        assert_eq!(off.offer(&parent, &tokens, 1), Some(1));
        assert_eq!(off.allocated_bytes(), 0);
    }

    #[test]
    fn what_it_cannot_key_is_handed_back() {
        let mut m: DigestMemo<u32> = DigestMemo::new(4, 2).unwrap();
        assert_eq!(m.insert(&[1u8; 33], &[1, 2], 5), Some(5)); // parent over 32 bytes
        assert_eq!(m.insert(&[1u8; 32], &[1, 2, 3], 6), Some(6)); // not one block
        let mut off: DigestMemo<u32> = DigestMemo::new(0, 2).unwrap();
        assert_eq!(off.capacity(), 0);
        assert_eq!(off.insert(&[1u8; 32], &[1, 2], 7), Some(7));
        assert_eq!(off.get(&[1u8; 32], &[1, 2]), None);
        assert!(m.is_empty() && off.is_empty());
        // keys over 1 GiB are refused, not attempted
        assert!(DigestMemo::<u32>::new(1 << 20, 1 << 10).is_err());
        assert!(DigestMemo::<u32>::new(4, usize::MAX).is_err());
        assert!(DigestMemo::<u32>::new(usize::MAX, 16).is_err());
    }

    #[test]
    fn a_set_keeps_its_most_recently_used_entries() {
        // 4 slots = one set of 4 ways: every key lands in it
        let mut m: DigestMemo<u64> = DigestMemo::new(1, 1).unwrap();
        assert_eq!(m.capacity(), 4);
        for t in 0..4 {
            assert_eq!(m.insert(&[1u8; 16], &[t], t as u64), None);
        }
        assert_eq!(m.get(&[1u8; 16], &[0]), Some(&0)); // 0 is now the most recently used
        assert_eq!(m.insert(&[1u8; 16], &[4], 4), Some(1)); // 1 was the least
        assert_eq!(m.get(&[1u8; 16], &[1]), None);
        assert_eq!(m.insert(&[1u8; 16], &[0], 10), Some(0)); // same key: replaced in place
        assert_eq!(m.get(&[1u8; 16], &[0]), Some(&10));
        assert_eq!(m.len(), 4);
        let mut held = m.clear();
        held.sort();
        assert_eq!(held, vec![2, 3, 4, 10]);
        assert_eq!(m.get(&[1u8; 16], &[2]), None);
        assert!(m.is_empty());
    }

    #[test]
    fn a_long_chain_stays_whole() {
        // 128 blocks of one prompt in 16384 slots: every one is still there afterwards
        let mut m: DigestMemo<usize> = DigestMemo::new(16384, 16).unwrap();
        let blocks: Vec<Vec<i64>> = (0..128).map(|b| (0..16).map(|t| (b * 16 + t) * 7919 % 128000).collect()).collect();
        for (i, b) in blocks.iter().enumerate() {
            m.insert(&[i as u8; 32], b, i);
        }
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(m.get(&[i as u8; 32], b), Some(&i));
        }
    }

    proptest! {
        /// Against a map of everything ever stored: a hit always returns the last value stored
        /// under exactly that key.
        #[test]
        fn hits_are_what_was_stored(ops in prop::collection::vec(
            (0u8..4, 0u8..4, any::<bool>(), prop::collection::vec(-2i64..3, 3), any::<u32>()), 1..200)) {
            // parents of 16 and 32 bytes, some equal on their first 16 (a zero tail)
            let mut m: DigestMemo<u32> = DigestMemo::new(4, 3).unwrap();
            let mut model: HashMap<(Vec<u8>, Vec<i64>), u32> = HashMap::new();
            for (op, p, short, toks, v) in ops {
                let mut parent = vec![p; 16];
                if !short {
                    parent.extend([0u8; 16]);
                }
                if op == 0 {
                    m.insert(&parent, &toks, v);
                    model.insert((parent, toks), v);
                } else if op == 1 {
                    // kept or not, a later hit must give v or the value held before
                    let _ = m.offer(&parent, &toks, v);
                    if m.get(&parent, &toks) == Some(&v) {
                        model.insert((parent, toks), v);
                    }
                } else if let Some(got) = m.get(&parent, &toks) {
                    prop_assert_eq!(Some(got), model.get(&(parent, toks)));
                }
            }
        }
    }
}

mod digest_memo_admission {
    use _core::hashing::digest_memo::DigestMemo;

    #[test]
    fn a_block_offered_by_its_sighting_key_is_kept_on_the_second_offer() {
        let mut m: DigestMemo<u32> = DigestMemo::new(64, 2).unwrap();
        let parent = [3u8; 32];
        let key = 0x9E37_79B9_7F4A_7C15u64; // what the caller derives from the block's digest
        assert_eq!(m.offer_sighted(key, &parent, &[1, 2], 7), Some(7)); // first sighting
        assert_eq!(m.get(&parent, &[1, 2]), None);
        // another sighting key is another block to the doorkeeper
        assert_eq!(m.offer_sighted(key ^ (1 << 40), &parent, &[1, 2], 6), Some(6));
        assert_eq!(m.offer_sighted(key, &parent, &[1, 2], 8), None); // second: kept
        assert_eq!(m.get(&parent, &[1, 2]), Some(&8)); // looked up by the exact key as ever
        assert_eq!(m.get(&parent, &[1, 3]), None);
        // what the memo cannot key is handed back, whatever the doorkeeper says
        assert_eq!(m.offer_sighted(key, &parent, &[1, 2, 3], 5), Some(5));
        assert_eq!(m.offer_sighted(key, &[0u8; 33], &[1, 2], 4), Some(4));
        let mut none: DigestMemo<u32> = DigestMemo::new(0, 2).unwrap();
        assert_eq!(none.offer_sighted(key, &parent, &[1, 2], 3), Some(3));
        assert_eq!(none.offer_sighted(key, &parent, &[1, 2], 3), Some(3));
        assert_eq!(m.stores(), 1);
    }

    #[test]
    fn a_block_is_kept_on_its_second_offer() {
        let mut m: DigestMemo<u32> = DigestMemo::new(64, 2).unwrap();
        let parent = [3u8; 32];
        assert_eq!(m.offer(&parent, &[1, 2], 7), Some(7)); // first sighting: handed back
        assert_eq!(m.get(&parent, &[1, 2]), None);
        assert_eq!(m.offer(&parent, &[1, 2], 8), None); // second: kept
        assert_eq!(m.get(&parent, &[1, 2]), Some(&8));
        assert_eq!(m.offer(&parent, &[1, 2], 9), Some(9)); // held: a first offer again
        assert_eq!(m.offer(&parent, &[1, 2], 10), Some(8)); // and then replaced in place
        assert_eq!(m.get(&parent, &[1, 2]), Some(&10));
        assert_eq!(m.stores(), 2);
        // a cleared memo forgets the sightings too
        m.clear();
        assert_eq!(m.offer(&parent, &[1, 2], 1), Some(1));
        assert_eq!(m.offer(&[4u8; 32], &[1, 2], 2), Some(2)); // another parent: another key
    }

    #[test]
    fn sightings_that_share_a_set_do_not_evict_each_other() {
        // 4 slots: one doorkeeper set of 4 per 2 memo slots... the smallest memo has 2 sets
        // of sightings, so among 3 keys two share one; offered in turn, all 3 are kept.
        let mut m: DigestMemo<u32> = DigestMemo::new(4, 1).unwrap();
        let parent = [9u8; 32];
        for round in 0..2 {
            for t in 0..3 {
                let _ = m.offer(&parent, &[t], round);
            }
        }
        for t in 0..3 {
            assert_eq!(m.get(&parent, &[t]), Some(&1));
        }
    }
}

/// `unpin_blocks` and its reuse watchers (vLLM's `BlockPool.unpin_blocks`, HiSparse residency):
/// released blocks join the queue tail whatever their hash, watchers fire when the pool hands
/// a block out or the cache is reset, in vLLM's order.
mod unpin_watchers {
    use _core::pool::block_pool::BlockPool;

    fn queue(p: &BlockPool) -> Vec<u32> {
        p.free_queue().collect()
    }

    #[test]
    fn released_blocks_join_the_tail_and_fire_when_reused() {
        let mut p = BlockPool::new(5, false, 4, false).unwrap();
        let mut held = Vec::new();
        p.get_new_blocks(2, &mut held).unwrap(); // 1, 2
        assert_eq!(queue(&p), vec![3, 4]);
        p.unpin_blocks(&[2, 1], 7).unwrap();
        // last-resort candidates, after the blocks already free, in the order released
        assert_eq!(queue(&p), vec![3, 4, 2, 1]);
        assert_eq!(p.num_free_blocks(), 4);
        assert!(p.has_watchers());
        let mut out = Vec::new();
        p.get_new_blocks(3, &mut out).unwrap();
        assert_eq!(out, vec![3, 4, 2]);
        assert_eq!(p.take_fired_watchers(), vec![(2, 7)]);
        assert!(p.take_fired_watchers().is_empty());
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_block_still_referenced_elsewhere_stays_in_use() {
        let mut p = BlockPool::new(4, true, 4, false).unwrap();
        let mut held = Vec::new();
        p.get_new_blocks(1, &mut held).unwrap();
        p.touch(&[1], true).unwrap(); // a second owner
        p.unpin_blocks(&[1], 3).unwrap();
        assert_eq!(p.ref_cnt(1).unwrap(), 1);
        assert_eq!(queue(&p), vec![2, 3]);
        // the watcher stays recorded: it fires once the other owner frees it and it is reused
        p.free_blocks(&[1], true).unwrap();
        let mut out = Vec::new();
        p.get_new_blocks(3, &mut out).unwrap();
        assert_eq!(out, vec![1, 2, 3]);
        assert_eq!(p.take_fired_watchers(), vec![(1, 3)]);
    }

    #[test]
    fn reset_fires_in_first_registration_order() {
        let mut p = BlockPool::new(6, true, 4, false).unwrap();
        let mut held = Vec::new();
        p.get_new_blocks(3, &mut held).unwrap(); // 1, 2, 3
        p.unpin_blocks(&[3], 10).unwrap();
        p.unpin_blocks(&[1], 11).unwrap();
        p.touch(&[3], true).unwrap();
        // re-registering block 3 keeps its place (a dict key re-assigned) with the new watcher
        p.unpin_blocks(&[3, 2], 12).unwrap();
        assert!(p.reset_prefix_cache());
        assert_eq!(p.take_fired_watchers(), vec![(3, 12), (1, 11), (2, 12)]);
        assert!(!p.has_watchers());
    }

    #[test]
    fn bad_unpins_change_nothing() {
        let mut p = BlockPool::new(4, true, 4, false).unwrap();
        let mut held = Vec::new();
        p.get_new_blocks(1, &mut held).unwrap();
        let before = queue(&p);
        assert!(p.unpin_blocks(&[0], 1).is_err()); // the null block
        assert!(p.unpin_blocks(&[1, 2], 1).is_err()); // 2 holds no reference
        assert!(p.unpin_blocks(&[1, 1], 1).is_err()); // one reference released twice
        assert!(p.unpin_blocks(&[9], 1).is_err()); // no such block
        assert_eq!(queue(&p), before);
        assert_eq!(p.ref_cnt(1).unwrap(), 1);
        assert!(!p.has_watchers());
    }
}

/// A host pool sharing the device pool's KV event queue (vLLM's `SharedEventQueueBlockPool`):
/// its events carry the host medium and merge into the device queue in recording order.
mod shared_event_queue {
    use _core::hashing::{BlockHasher, Digest, HashAlgo};
    use _core::pool::block_pool::BlockPool;
    use _core::pool::events::{Event, Medium};

    fn hashes(n: usize) -> Vec<Digest> {
        let tokens: Vec<i64> = (0..(n * 4) as i64).collect();
        BlockHasher::new(HashAlgo::Sha256).hash_chain(0, &[1u8; 32], &tokens, 4, |_| None).unwrap()
    }

    fn stored_group(e: &Event) -> Option<(u32, Medium)> {
        match e {
            Event::BlockStored { group, medium, .. } => Some((*group, *medium)),
            _ => None,
        }
    }

    fn pools() -> (BlockPool, BlockPool) {
        let mut device = BlockPool::new(8, true, 4, true).unwrap();
        let mut host = BlockPool::new(8, true, 4, false).unwrap();
        device.set_event_sharing(true, Medium::Device, true);
        host.set_event_sharing(true, Medium::Host, true);
        (device, host)
    }

    #[test]
    fn interleaved_events_merge_in_recording_order() {
        let (mut device, mut host) = pools();
        let h = hashes(3);
        let mut d = Vec::new();
        let mut hb = Vec::new();
        device.get_new_blocks(3, &mut d).unwrap();
        host.get_new_blocks(3, &mut hb).unwrap();
        // device g1, host g0, device g2 (moved only at the end)
        device.cache_full_blocks(&d[..1], 0, 1, &h, 4, 1, None, 0).unwrap();
        host.cache_full_blocks(&hb[..1], 0, 1, &h, 4, 0, None, 0).unwrap();
        device.cache_full_blocks(&d[1..2], 0, 1, &hashes(1), 4, 2, None, 0).unwrap();
        device.absorb_events(&mut host);
        assert_eq!(host.num_pending_events(), 0);
        let order: Vec<_> = device.take_events().iter().filter_map(stored_group).collect();
        assert_eq!(order, vec![(1, Medium::Device), (0, Medium::Host), (2, Medium::Device)]);
    }

    #[test]
    fn later_host_events_append_and_removals_keep_the_host_medium() {
        let (mut device, mut host) = pools();
        let h = hashes(1);
        let mut hb = Vec::new();
        host.get_new_blocks(1, &mut hb).unwrap();
        host.cache_full_blocks(&hb, 0, 1, &h, 4, 0, None, 0).unwrap();
        device.absorb_events(&mut host);
        host.evict_blocks(&hb).unwrap();
        device.absorb_events(&mut host);
        let events = device.take_events();
        assert_eq!(events.len(), 2);
        assert!(matches!(events[1], Event::BlockRemoved { medium: Medium::Host, group: 0, .. }));
        // nothing left behind; a second drain is empty
        device.absorb_events(&mut host);
        assert!(device.take_events().is_empty());
    }
}

/// Residency metrics moved to a rebuilt pool (HiSparse's host pool when its tier is reset):
/// the rate, generator and pending events go with them; a pool of another size refuses them.
mod residency_restore {
    use _core::pool::block_pool::BlockPool;

    #[test]
    fn a_pool_of_the_same_size_takes_them_another_refuses_them() {
        let mut old = BlockPool::new(8, true, 4, false).unwrap();
        old.enable_residency(1.0, 7).unwrap();
        let mut got = Vec::new();
        old.get_new_blocks(3, &mut got).unwrap();
        old.free_blocks(&got, true).unwrap();
        got.clear();
        old.get_new_blocks(7, &mut got).unwrap(); // the 3 sampled blocks evicted (caching on)
        let mut metrics = old.residency().unwrap().clone();
        assert_eq!(metrics.num_pending_events(), 3);
        metrics.clear_samples();
        let mut other = BlockPool::new(6, true, 4, false).unwrap();
        assert!(other.restore_residency(metrics.clone()).is_err());
        assert!(other.residency().is_none());
        let mut rebuilt = BlockPool::new(8, true, 4, false).unwrap();
        rebuilt.restore_residency(metrics).unwrap();
        let r = rebuilt.residency().unwrap();
        assert_eq!((r.len(), r.num_pending_events(), r.sample_rate()), (0, 3, 1.0));
        got.clear();
        rebuilt.get_new_blocks(2, &mut got).unwrap();
        assert_eq!(rebuilt.residency().unwrap().sampled_ids(), got);
    }
}

/// Bad input to the pool's raw faces is refused before anything changes: a block listed twice
/// in one kvblock `cache_full_blocks`, the null block given a key (it would become a prefix
/// hit), a clock reading that is not finite.
mod refused_input {
    use _core::error::Error;
    use _core::hashing::{BlockHasher, Digest, HashAlgo};
    use _core::pool::block_pool::{BlockPool, NULL_BLOCK};
    use _core::pool::cache_map::Key;

    fn hashes(n: usize) -> Vec<Digest> {
        let tokens: Vec<i64> = (0..(n * 4) as i64).collect();
        BlockHasher::new(HashAlgo::Sha256).hash_chain(0, &[1u8; 32], &tokens, 4, |_| None).unwrap()
    }

    /// The free queue, the map's keys with their blocks (sorted) and the pending events.
    type State = (Vec<u32>, Vec<(Key, Vec<u32>)>, usize);

    /// What a refused call must leave as it was.
    fn state(p: &BlockPool) -> State {
        let mut map: Vec<(Key, Vec<u32>)> = p.cache_map().iter().collect();
        map.sort_by(|a, b| (a.0.hash.as_bytes(), a.0.group).cmp(&(b.0.hash.as_bytes(), b.0.group)));
        (p.free_queue().collect(), map, p.num_pending_events())
    }

    fn value_error_naming(r: _core::error::Result<()>, arg: &str) {
        match r {
            Err(Error::Value(m)) => assert!(m.starts_with(&format!("{arg}: ")), "{m}"),
            other => panic!("expected a value error naming {arg}, got {other:?}"),
        }
    }

    #[test]
    fn a_block_listed_twice_is_found_before_caching() {
        let mut p = BlockPool::new(8, true, 4, true).unwrap();
        let mut b = Vec::new();
        p.get_new_blocks(2, &mut b).unwrap();
        let before = state(&p);
        let table = [b[0], b[1], b[0]];
        let r = p.check_distinct_blocks(&table, 0, 3, None, "block_ids");
        match &r {
            Err(Error::Value(m)) => assert!(m.contains(&format!("block {} is listed twice (at 0 and 2)", b[0])), "{m}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(state(&p), before);
        // the null block, masked-out blocks and blocks outside the range are not cached: not repeats
        p.check_distinct_blocks(&[NULL_BLOCK, b[0], NULL_BLOCK, b[1]], 0, 4, None, "blocks").unwrap();
        p.check_distinct_blocks(&table, 0, 3, Some(&[true, true, false]), "blocks").unwrap();
        p.check_distinct_blocks(&table, 1, 3, None, "blocks").unwrap();
        p.check_distinct_blocks(&table, 0, 2, None, "blocks").unwrap();
        // distinct blocks are cached as before
        p.cache_full_blocks(&b, 0, 2, &hashes(2), 4, 0, None, 0).unwrap();
        p.check_invariants().unwrap();
    }

    #[test]
    fn moving_a_key_onto_the_null_block_is_refused() {
        let mut p = BlockPool::new(8, true, 4, true).unwrap();
        let mut b = Vec::new();
        p.get_new_blocks(1, &mut b).unwrap();
        p.cache_full_blocks(&b, 0, 1, &hashes(1), 4, 0, None, 0).unwrap();
        let before = state(&p);
        value_error_naming(p.move_block_hashes(b[0], NULL_BLOCK), "dst");
        assert_eq!(state(&p), before);
        assert_eq!(p.block_key(NULL_BLOCK).unwrap(), None);
        assert_eq!(p.lookup(&hashes(1)[0], 0), Some(b[0]));
        p.check_invariants().unwrap();
        // the raw faces vLLM's code and tests use key it by hand, as vLLM's map does
        // (vLLM's test_maybe_evict_cached_block)
        let key = Key { hash: hashes(2)[1], group: 0 };
        p.set_block_hash(NULL_BLOCK, key, Some(4)).unwrap();
        p.map_insert(key, NULL_BLOCK).unwrap();
        assert_eq!(p.block_key(NULL_BLOCK).unwrap(), Some(key));
    }

    #[test]
    fn a_time_that_is_not_finite_is_refused_with_retention_on_or_off() {
        for retention in [false, true] {
            let mut p = BlockPool::new(8, true, 4, false).unwrap();
            if retention {
                p.enable_retention(35, 1.0).unwrap();
                p.set_time(5.0).unwrap();
            }
            for t in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                value_error_naming(p.set_time(t), "now_s");
            }
            p.set_time(6.0).unwrap();
        }
    }
}
