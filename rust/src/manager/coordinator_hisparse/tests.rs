//! A manager with HiSparse groups, in vLLM's test layout (`make_hisparse_kv_cache_config`:
//! source, indexer, resident, hot with two blocks per request), driven through
//! `KVCacheManager` as the connector drives vLLM's: counts and tables worked from vLLM
//! 0.33.0's `HiSparseSourceManager` / `HiSparseResidentManager` / `HiSparseHotManager` and
//! `HiSparseCoordinator`.

use crate::error::Error;
use crate::hashing::Digest;
use crate::hisparse::residency::Env;
use crate::manager::spec::{Caller, GroupSpec, Kind, ManagerConfig};
use crate::manager::{AllocArgs, KVCacheManager, RequestView};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};

const BS: usize = 16;
const SOURCE: usize = 0;
const INDEXER: usize = 1;
const RESIDENT: usize = 2;
const HOT: usize = 3;

fn group(kind: Kind, class: u32, prefix_cacheable: bool) -> GroupSpec {
    GroupSpec {
        kind,
        block_size: BS,
        prefix_cacheable,
        dcp_sharded: false,
        is_eagle_group: false,
        zeroed: false,
        spec_class: class,
    }
}

fn config(num_blocks: usize, host: Option<usize>, caching: bool) -> ManagerConfig {
    let groups = vec![
        group(Kind::HiSparseSource, 0, true),
        group(Kind::FullAttention, 1, true),
        group(Kind::HiSparseResident, 2, false),
        group(Kind::HiSparseHot { blocks_per_request: 2 }, 3, false),
    ];
    ManagerConfig {
        max_in_flight_tokens: 32,
        enable_caching: caching,
        hisparse_host_num_blocks: host,
        ..ManagerConfig::new(groups, num_blocks, 256, BS, Caller::Vllm)
    }
}

fn build(num_blocks: usize, host: usize, caching: bool) -> (KVCacheManager, BlockPool) {
    let m = KVCacheManager::new(&config(num_blocks, Some(host), caching)).unwrap();
    (m, BlockPool::new(num_blocks, caching, BS, false).unwrap())
}

/// One hash per block; requests with equal `seed` share a prompt.
fn hashes(seed: u8, num_tokens: usize) -> Vec<Digest> {
    (0..num_tokens / BS).map(|i| Digest::from_slice(&[seed, i as u8, 7, 7]).unwrap()).collect()
}

/// `allocate_slots(request, num_new_tokens)` for a request of `num_tokens` tokens of which
/// `computed` are computed.
fn alloc(
    m: &mut KVCacheManager,
    p: &mut BlockPool,
    id: &str,
    seed: u8,
    num_tokens: usize,
    computed: usize,
    num_new: usize,
) -> Option<Vec<Vec<u32>>> {
    let hs = hashes(seed, num_tokens);
    let req = RequestView {
        request_id: id,
        num_computed_tokens: computed,
        num_tokens,
        num_prompt_tokens: num_tokens,
        ..Default::default()
    };
    let args = AllocArgs { num_new_tokens: num_new, ..Default::default() };
    m.allocate_slots(p, &req, &hs, &args).unwrap()
}

fn table(m: &KVCacheManager, id: &str, group: usize) -> Vec<u32> {
    m.coord.get_blocks(id)[group].to_vec()
}

fn host_free(m: &KVCacheManager) -> usize {
    m.coord.hisparse().unwrap().host.num_free_blocks()
}

/// The connector's step for `id`: `advance_scheduled`, then every planned spill enqueued and
/// completed by one worker (`build_offload_command`, `update_spills`).
fn spill_all(m: &mut KVCacheManager, p: &mut BlockPool, id: &str, num_tokens: usize) {
    m.coord
        .with_residency(p, |res, env| {
            res.advance_scheduled(env, &[(id.to_string(), num_tokens)])?;
            let ids: Vec<(u64, usize)> =
                res.take_offload_command().unwrap_or_default().iter().map(|t| (t.transfer_id, 1)).collect();
            res.update_spills(env, &ids, &ids)
        })
        .unwrap();
}

#[test]
fn a_hisparse_configuration_builds_a_host_pool_and_a_residency() {
    let (m, _) = build(32, 16, false);
    let tier = m.coord.hisparse().expect("a HiSparse tier");
    assert_eq!(tier.host.num_blocks(), 16);
    assert_eq!(tier.host.num_free_blocks(), 15); // the host pool's own null block
    assert_eq!(tier.host_group(), SOURCE);
    assert_eq!(tier.residency.layout().resident_groups, vec![RESIDENT]);
    assert_eq!(tier.residency.layout().hot_groups, vec![(HOT, 2)]);
    // vLLM: max(hot blocks per request, num_blocks // 10)
    assert_eq!(tier.residency.transition_watermark(), 3);
    assert_eq!(tier.residency.max_spill_pages(), 256 / BS);
}

#[test]
fn vllm_configuration_errors_build_nothing() {
    let err = KVCacheManager::new(&config(32, None, false)).unwrap_err();
    assert!(matches!(&err, Error::Value(m) if m == "HiSparse host group needs host capacity."), "{err:?}");
    let mut cfg = config(32, Some(16), false);
    cfg.groups.swap(SOURCE, RESIDENT);
    let err = KVCacheManager::new(&cfg).unwrap_err();
    assert!(matches!(&err, Error::Value(m) if m == "HiSparse host group must precede resident groups."), "{err:?}");
    let mut cfg = config(32, Some(16), false);
    cfg.groups.push(group(Kind::HiSparseSource, 4, true));
    let err = KVCacheManager::new(&cfg).unwrap_err();
    assert!(matches!(&err, Error::Value(m) if m == "Only one HiSparse host group is supported."), "{err:?}");
    assert!(KVCacheManager::new(&config(32, Some(0), false)).is_err());
}

#[test]
fn a_new_request_takes_host_blocks_for_the_source_group_and_no_hot_region() {
    let (mut m, mut p) = build(32, 16, false);
    let new = alloc(&mut m, &mut p, "a", 1, 40, 0, 40).expect("fits");
    // source: 3 host blocks (host ids); indexer and resident: 3 device blocks each; hot: none
    assert_eq!(new.iter().map(|g| g.len()).collect::<Vec<_>>(), vec![3, 3, 3, 0]);
    assert_eq!(host_free(&m), 12);
    assert_eq!(p.num_free_blocks(), 31 - 6);
    assert_eq!(table(&m, "a", SOURCE), new[SOURCE]);
    // freeing gives each group's blocks back to its own pool
    m.free(&mut p, "a").unwrap();
    assert_eq!(host_free(&m), 15);
    assert_eq!(p.num_free_blocks(), 31);
    assert!(m.coord.request_ids().is_empty());
}

#[test]
fn a_full_host_pool_refuses_the_request_with_the_admission_sentinel() {
    let (mut m, mut p) = build(32, 4, false);
    // 3 host blocks free, 4 needed: the source group counts num_gpu_blocks + 1
    assert_eq!(alloc(&mut m, &mut p, "a", 1, 64, 0, 64), None);
    assert_eq!(host_free(&m), 3);
    assert_eq!(p.num_free_blocks(), 31);
    assert!(m.coord.request_ids().is_empty());
    assert!(alloc(&mut m, &mut p, "a", 1, 48, 0, 48).is_some());
}

#[test]
fn a_request_filling_its_admission_window_gets_a_hot_region_next_step() {
    let (mut m, mut p) = build(32, 32, false);
    alloc(&mut m, &mut p, "a", 1, 40, 0, 40).unwrap();
    // 3 resident pages >= the admission cap cdiv(32, 16) = 2: update_residency asks for hot
    spill_all(&mut m, &mut p, "a", 40);
    assert!(m.coord.hisparse().unwrap().residency.hot_required(0).contains("a"));
    let new = alloc(&mut m, &mut p, "a", 1, 41, 40, 1).unwrap();
    assert_eq!(new[HOT].len(), 2);
    assert_eq!(table(&m, "a", HOT).len(), 2);
    // freeing drops hot_required with the region
    m.free(&mut p, "a").unwrap();
    assert!(!m.coord.hisparse().unwrap().residency.hot_required(0).contains("a"));
    assert_eq!(p.num_free_blocks(), 31);
    assert_eq!(host_free(&m), 31);
}

#[test]
fn a_released_page_reused_inside_allocate_slots_is_lost_at_once() {
    let (mut m, mut p) = build(32, 40, false);
    alloc(&mut m, &mut p, "a", 1, 40, 0, 40).unwrap();
    spill_all(&mut m, &mut p, "a", 40); // pages 0 and 1 spill; "a" needs a hot region
    alloc(&mut m, &mut p, "a", 1, 41, 40, 1).unwrap(); // the hot region
    spill_all(&mut m, &mut p, "a", 41); // no new page; "a" reads from the host now
    let resident = table(&m, "a", RESIDENT);
    let tier = m.coord.hisparse().unwrap();
    let st = tier.residency.request_state("a").unwrap();
    // page 0 is clean and released (page 1 is within ACTIVE_TAIL_PAGES of the tail)
    assert!(st.unpinned_pages.contains(&0), "{st:?}");
    assert!(p.is_free(resident[0]));
    // "b" takes every free device block, the released one last
    let free = p.num_free_blocks();
    assert_eq!(free % 2, 0);
    let tokens = free / 2 * BS;
    let new = alloc(&mut m, &mut p, "b", 2, tokens, 0, tokens).unwrap();
    assert!(new[RESIDENT].contains(&resident[0]));
    // the watcher fired inside that call: page 0 of "a" is read from the host now
    let tier = m.coord.hisparse().unwrap();
    assert_eq!(tier.residency.residency_changes(0)["a"].get(&0), Some(&NULL_BLOCK));
    assert!(!tier.residency.request_state("a").unwrap().unpinned_pages.contains(&0));
    m.free(&mut p, "b").unwrap();
    m.free(&mut p, "a").unwrap();
    assert_eq!(p.num_free_blocks(), 31);
}

#[test]
fn durable_host_pages_are_published_and_hit_from_the_host_pool() {
    let (mut m, mut p) = build(32, 16, true);
    alloc(&mut m, &mut p, "a", 1, 40, 0, 40).unwrap();
    let host_blocks = table(&m, "a", SOURCE);
    // caching waits for durable pages: nothing published yet, the publication kept
    let tier = m.coord.hisparse().unwrap();
    assert_eq!(tier.host.block_key(host_blocks[0]).unwrap(), None);
    assert_eq!(tier.num_kept_publications(), 1);
    spill_all(&mut m, &mut p, "a", 40);
    let tier = m.coord.hisparse().unwrap();
    assert!(tier.host.block_key(host_blocks[0]).unwrap().is_some());
    assert!(tier.host.block_key(host_blocks[1]).unwrap().is_some());
    // published; the running request's inputs stay for its next publication
    assert_eq!(tier.num_kept_publications(), 1);
    // a request with the same prompt hits the host group on the host pool
    let hs = hashes(1, 40);
    let (hit, _, _) = m.get_computed_blocks(&p, true, 40, &hs, None, None, true).unwrap();
    assert_eq!(hit[SOURCE], host_blocks[..2].to_vec());
    assert!(hit[RESIDENT].is_empty() && hit[HOT].is_empty());
    m.free(&mut p, "a").unwrap();
    assert_eq!(m.coord.hisparse().unwrap().num_kept_publications(), 0);
}

#[test]
fn the_residency_reads_the_managers_tables() {
    let (mut m, mut p) = build(32, 16, false);
    alloc(&mut m, &mut p, "a", 1, 20, 0, 20).unwrap();
    let (source, resident) = (table(&m, "a", SOURCE), table(&m, "a", RESIDENT));
    m.coord
        .with_residency(&mut p, |res, env| {
            assert_eq!(env.table(SOURCE, "a"), Some(source.as_slice()));
            assert_eq!(res.get_residency_row(env, 0, "a", 0), resident);
            // vLLM's hot manager makes no table for a request that needs no region
            assert_eq!(env.table(HOT, "a"), None);
            assert_eq!(env.table(INDEXER, "a").map(|t| t.len()), Some(2));
            assert_eq!(env.table(SOURCE, "b"), None);
            Ok(())
        })
        .unwrap();
}

#[test]
fn pop_blocks_for_free_is_refused_with_two_pools() {
    let (mut m, mut p) = build(32, 16, false);
    alloc(&mut m, &mut p, "a", 1, 20, 0, 20).unwrap();
    assert!(matches!(m.coord.pop_blocks_for_free("a"), Err(Error::NotImplemented(_))));
    assert_eq!(table(&m, "a", SOURCE).len(), 2);
}

#[test]
fn the_residency_takes_only_its_own_fired_watchers() {
    use crate::hisparse::residency::RESIDENCY_WATCHER;
    let mut p = BlockPool::new(4, false, BS, false).unwrap();
    let mut got = Vec::new();
    p.get_new_blocks(3, &mut got).unwrap();
    p.unpin_blocks(&[got[0]], 5).unwrap();
    p.unpin_blocks(&[got[1]], RESIDENCY_WATCHER).unwrap();
    p.unpin_blocks(&[got[2]], 6).unwrap();
    let mut again = Vec::new();
    p.get_new_blocks(3, &mut again).unwrap();
    // a Python caller's take leaves the residency's entry for the manager
    assert_eq!(p.take_fired_watchers_except(RESIDENCY_WATCHER), vec![(got[0], 5), (got[2], 6)]);
    assert_eq!(p.take_fired_watchers_of(RESIDENCY_WATCHER), vec![got[1]]);
    assert!(p.take_fired_watchers().is_empty());
}

#[test]
fn an_external_import_keeps_its_host_reservation_on_0_34() {
    let mut cfg = config(32, Some(16), false);
    cfg.hisparse_import_step_tokens = Some(BS);
    let mut m = KVCacheManager::new(&cfg).unwrap();
    let mut p = BlockPool::new(32, false, BS, false).unwrap();
    let hs = hashes(1, 64);
    let req = RequestView { request_id: "a", num_tokens: 64, num_prompt_tokens: 64, ..Default::default() };
    let args = AllocArgs {
        num_new_tokens: 16,
        num_external_computed_tokens: 48,
        full_sequence_must_fit: true,
        ..Default::default()
    };
    let new = m.allocate_slots(&mut p, &req, &hs, &args).unwrap().expect("fits");
    // the admission gate sized the import at cdiv(64 + 16, 16) = 5 host pages; the request
    // holds 4 (3 imported, 1 new): one page stays reserved
    assert_eq!(table(&m, "a", SOURCE).len(), 4);
    assert_eq!(m.coord.hisparse().unwrap().residency.reserved_import_pages(), 1);
    // the resident group: host-only imported pages, a writable last imported page, one more
    let resident = table(&m, "a", RESIDENT);
    assert_eq!(resident.len(), 4);
    assert_eq!(&resident[..2], &[NULL_BLOCK, NULL_BLOCK]);
    assert!(resident[2] != NULL_BLOCK && resident[3] != NULL_BLOCK);
    // the hot group: an import reads host-backed history
    assert_eq!(new[HOT].len(), 2);
    m.free(&mut p, "a").unwrap();
    assert_eq!(m.coord.hisparse().unwrap().residency.reserved_import_pages(), 0);
    assert_eq!(p.num_free_blocks(), 31);
    assert_eq!(host_free(&m), 15);
}

#[test]
fn release_0_32_pops_the_resident_row_with_its_null_head() {
    for trim in [true, false] {
        let mut cfg = config(32, Some(16), false);
        cfg.rules.hisparse_trim_null_head = trim;
        let mut m = KVCacheManager::new(&cfg).unwrap();
        let mut p = BlockPool::new(32, false, BS, false).unwrap();
        let hs = hashes(1, 64);
        let req = RequestView { request_id: "a", num_tokens: 64, num_prompt_tokens: 64, ..Default::default() };
        let args = AllocArgs { num_new_tokens: 16, num_external_computed_tokens: 48, ..Default::default() };
        m.allocate_slots(&mut p, &req, &hs, &args).unwrap().expect("fits");
        let resident = table(&m, "a", RESIDENT);
        let slot = m.coord.slot("a").unwrap();
        let row = m.coord.hisparse_pop(&mut p, RESIDENT, slot, "a", true).unwrap();
        // 0.33+: trim_null_head; 0.32: the whole row, host-only head included
        assert_eq!(row, if trim { resident[2..].to_vec() } else { resident.clone() }, "trim={trim}");
    }
}

#[test]
fn a_finished_request_publishes_its_host_pages_once_its_spills_complete() {
    for finished in [true, false] {
        let (mut m, mut p) = build(32, 16, true);
        alloc(&mut m, &mut p, "a", 1, 40, 0, 40).unwrap();
        let host_blocks = table(&m, "a", SOURCE);
        // the spills of pages 0 and 1 are planned and sent, not yet done
        let ids: Vec<(u64, usize)> = m
            .coord
            .with_residency(&mut p, |res, env| {
                res.advance_scheduled(env, &[("a".to_string(), 40)])?;
                Ok(res.take_offload_command().unwrap_or_default().iter().map(|t| (t.transfer_id, 1)).collect())
            })
            .unwrap()
            .unwrap();
        assert_eq!(ids.len(), 2);
        m.free_request(&mut p, "a", finished).unwrap();
        // a finished request's pages stay held for its publication; a preempted one's only
        // for the running spills
        assert_eq!(m.coord.hisparse().unwrap().num_kept_publications(), finished as usize);
        m.coord.with_residency(&mut p, |res, env| res.update_spills(env, &ids, &ids)).unwrap();
        let tier = m.coord.hisparse().unwrap();
        assert_eq!(tier.host.num_free_blocks(), 15);
        assert_eq!(tier.num_kept_publications(), 0);
        for &b in &host_blocks[..2] {
            assert_eq!(tier.host.block_key(b).unwrap().is_some(), finished, "finished={finished}");
        }
        assert_eq!(p.num_free_blocks(), 31);
    }
}

/// A partial prefix hit on host block `src` for request `id` in the source group (as vLLM's
/// test sets `req_to_blocks` and `_partial_hit_reqs` by hand); returns the request's slot.
fn source_partial_hit(m: &mut KVCacheManager, id: &str, src: u32) -> usize {
    let slot = m.coord.slot_or_insert(id);
    let g = &mut m.coord.managers[SOURCE];
    g.ensure_slot(slot);
    let r = &mut g.reqs[slot];
    r.present = true;
    r.blocks = vec![src];
    r.partial_hit = Some((0, src));
    slot
}

fn new_host_block(m: &mut KVCacheManager) -> u32 {
    let mut got = Vec::new();
    m.coord.hisparse.as_deref_mut().unwrap().host.get_new_blocks(1, &mut got).unwrap();
    got[0]
}

fn has_pending_work(m: &mut KVCacheManager, p: &mut BlockPool) -> bool {
    m.coord.with_residency(p, |r, _| Ok(r.has_pending_work())).unwrap().unwrap()
}

#[test]
fn the_host_copy_on_write_goes_to_the_connector_and_keeps_both_endpoints_until_it_ran() {
    let (mut m, mut p) = build(32, 16, false);
    let src = new_host_block(&mut m);
    let slot = source_partial_hit(&mut m, "cow", src);
    let new = m.coord.hisparse_allocate_new(&mut p, SOURCE, slot, "cow", BS, BS).unwrap();
    assert_eq!(new.len(), 1);
    let cow = new[0];
    assert_eq!(table(&m, "cow", SOURCE), vec![cow]);
    assert_eq!(host_free(&m), 13);
    // not the worker's device copy path, and no new block ids to zero
    assert!(m.take_kv_cache_block_copies().is_empty());
    assert!(m.take_new_block_ids().is_empty());
    assert!(!has_pending_work(&mut m, &mut p));
    assert_eq!(m.coord.hisparse_take_host_block_copies(), vec![(src, cow)]);
    assert!(m.coord.hisparse_take_host_block_copies().is_empty());
    assert!(has_pending_work(&mut m, &mut p));
    // the request goes; both endpoints stay held until the worker reports the copy
    m.free(&mut p, "cow").unwrap();
    assert_eq!(host_free(&m), 13);
    let release = |m: &mut KVCacheManager, p: &mut BlockPool, ids: &[u32]| {
        m.coord.with_residency(p, |r, e| r.release_completed_host_copies(e, ids)).unwrap().unwrap()
    };
    release(&mut m, &mut p, &[src, 99]); // not a copy's destination: nothing
    assert_eq!(host_free(&m), 13);
    release(&mut m, &mut p, &[cow]);
    assert_eq!(host_free(&m), 15);
    assert!(!has_pending_work(&mut m, &mut p));
}

#[test]
fn take_host_cow_copies_drains_without_retaining() {
    let (mut m, mut p) = build(32, 16, false);
    let src = new_host_block(&mut m);
    let slot = source_partial_hit(&mut m, "cow", src);
    let cow = m.coord.hisparse_allocate_new(&mut p, SOURCE, slot, "cow", BS, BS).unwrap()[0];
    assert_eq!(m.coord.hisparse_take_host_cow_copies(), vec![(src, cow)]);
    assert!(m.coord.hisparse_take_host_cow_copies().is_empty());
    assert!(!has_pending_work(&mut m, &mut p));
}

#[test]
fn the_source_count_includes_the_hit_and_the_copy_on_write_block() {
    // vLLM's test_hisparse_import_capacity_includes_hits_and_cow: one hit block held, the
    // host pool's free blocks against the full-attention count on the host pool
    for (local, free, admitted) in [(BS, 1, true), (BS - 1, 1, false), (BS - 1, 2, true)] {
        let (mut m, p) = build(32, free + 2, false);
        let hit = new_host_block(&mut m);
        assert_eq!(host_free(&m), free);
        let slot = m.coord.slot_or_insert("waiting");
        let n = m.coord.hisparse_num_blocks(&p, SOURCE, slot, "waiting", 32, &[hit], 32, local, false).unwrap();
        // 0 when the host pool backs it, else the admission sentinel num_gpu_blocks + 1
        assert_eq!(n, if admitted { 0 } else { 33 }, "local {local} free {free}");
    }
}

#[test]
fn pop_blocks_for_free_routed_returns_host_and_device_blocks_unfreed() {
    let (mut m, mut p) = build(32, 16, false);
    let new = alloc(&mut m, &mut p, "a", 1, 20, 0, 20).unwrap();
    let (host_before, device_before) = (host_free(&m), p.num_free_blocks());
    let popped = m.coord.pop_blocks_for_free_routed(&mut p, "a", false).unwrap();
    let want: Vec<(u32, bool)> =
        new.iter().enumerate().flat_map(|(g, ids)| ids.iter().map(move |&b| (b, g == SOURCE))).collect();
    assert_eq!(popped, want);
    // nothing freed yet; the request is gone everywhere
    assert_eq!((host_free(&m), p.num_free_blocks()), (host_before, device_before));
    assert!(m.coord.request_ids().is_empty());
    assert!(m.coord.pop_blocks_for_free_routed(&mut p, "a", false).unwrap().is_empty());
    // the caller frees each block into its own pool
    let (host, device): (Vec<_>, Vec<_>) = popped.iter().rev().partition(|(_, h)| *h);
    let ids = |v: Vec<&(u32, bool)>| v.into_iter().map(|(b, _)| *b).collect::<Vec<_>>();
    m.coord.hisparse.as_deref_mut().unwrap().host.free_blocks(&ids(host), true).unwrap();
    p.free_blocks(&ids(device), true).unwrap();
    assert_eq!((host_free(&m), p.num_free_blocks()), (15, 31));
}

#[test]
fn a_failed_host_copy_release_releases_nothing() {
    let (mut m, mut p) = build(32, 16, false);
    let src = new_host_block(&mut m);
    let slot = source_partial_hit(&mut m, "cow", src);
    let cow = m.coord.hisparse_allocate_new(&mut p, SOURCE, slot, "cow", BS, BS).unwrap()[0];
    m.coord.hisparse_take_host_block_copies();
    m.free(&mut p, "cow").unwrap();
    // other code drops the source's last reference: the release fails, keeping the copy
    m.coord.hisparse.as_deref_mut().unwrap().host.free_blocks(&[src], true).unwrap();
    let free = host_free(&m);
    let res = m.coord.with_residency(&mut p, |r, e| r.release_completed_host_copies(e, &[cow]));
    assert!(res.is_err());
    assert_eq!(host_free(&m), free);
    assert!(has_pending_work(&mut m, &mut p));
    // once the source is held again the copy is released
    m.coord.hisparse.as_deref_mut().unwrap().host.touch(&[src], true).unwrap();
    m.coord.with_residency(&mut p, |r, e| r.release_completed_host_copies(e, &[cow, cow])).unwrap().unwrap();
    assert_eq!(host_free(&m), 15);
    assert!(!has_pending_work(&mut m, &mut p));
}

/// `allocate_is_noop` for a decode step of `id` (`computed` of `computed + 1` tokens).
fn decode_is_noop(m: &KVCacheManager, id: &str, computed: usize) -> bool {
    let args = AllocArgs { num_new_tokens: 1, ..Default::default() };
    m.allocate_is_noop(id, computed, computed + 1, 0, &args)
}

#[test]
fn a_decode_step_inside_a_page_with_its_publication_settled_is_a_noop() {
    let (mut m, mut p) = build(64, 64, true);
    alloc(&mut m, &mut p, "a", 1, 40, 0, 40).unwrap();
    // pages 0 and 1 are sealed but not yet on the host: the publication is owed
    assert!(!decode_is_noop(&m, "a", 40));
    spill_all(&mut m, &mut p, "a", 40);
    // "a" fills its admission window: it needs a hot region, which the next step takes
    assert!(m.coord.hisparse().unwrap().residency.hot_required(0).contains("a"));
    assert!(!decode_is_noop(&m, "a", 40));
    assert_eq!(alloc(&mut m, &mut p, "a", 1, 41, 40, 1).unwrap()[HOT].len(), 2);
    spill_all(&mut m, &mut p, "a", 41);
    // page 2 has room, the hot region is whole, the sealed pages are published: nothing to do
    assert!(decode_is_noop(&m, "a", 41));
    let before = (format!("{:?}", m.coord.hisparse().unwrap().residency), m.coord.get_blocks("a").concat());
    let (free, host) = (p.num_free_blocks(), host_free(&m));
    // and the full path agrees: no block, nothing changed
    assert!(alloc(&mut m, &mut p, "a", 1, 42, 41, 1).unwrap().iter().all(Vec::is_empty));
    let after = (format!("{:?}", m.coord.hisparse().unwrap().residency), m.coord.get_blocks("a").concat());
    assert_eq!(before, after);
    assert_eq!((p.num_free_blocks(), host_free(&m)), (free, host));
    // the step that needs page 3 (token 48) allocates
    assert!(!decode_is_noop(&m, "a", 48));
}
