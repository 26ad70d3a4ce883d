//! The residency's transitions on real pools, in the layout of vLLM's HiSparse tests
//! (source group 0 on the host pool, indexer 1, resident 2, hot 3 with two blocks per request,
//! block size 16). Expected values follow vLLM's `HiSparseCoordinator`.

use std::collections::HashMap;

use super::*;
use crate::hashing::Digest;

const BS: usize = 16;
const HOST: usize = 0;
const RESIDENT: usize = 2;
const HOT: usize = 3;

struct TestEnv {
    tables: HashMap<(usize, String), Vec<u32>>,
    device: BlockPool,
    host: BlockPool,
    published: Vec<(String, usize)>,
    detached: Vec<(String, Vec<u32>, usize, usize)>,
}

impl TestEnv {
    fn new(device_blocks: usize, host_blocks: usize) -> Self {
        TestEnv {
            tables: HashMap::new(),
            device: BlockPool::new(device_blocks, true, BS, false).unwrap(),
            host: BlockPool::new(host_blocks, true, BS, false).unwrap(),
            published: Vec::new(),
            detached: Vec::new(),
        }
    }

    /// Give `request` `n` new blocks in `group` (from that group's pool).
    fn grow(&mut self, group: usize, request: &str, n: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let pool = if group == HOST { &mut self.host } else { &mut self.device };
        pool.get_new_blocks(n, &mut out).unwrap();
        self.tables.entry((group, request.to_string())).or_default().extend(&out);
        out
    }

    /// Host key of page `page` of `request`'s prompt (a distinct hash per page).
    fn key(page: usize) -> Key {
        Key { hash: Digest::from_slice(&[page as u8 + 1; 16]).unwrap(), group: HOST as u32 }
    }
}

impl Env for TestEnv {
    fn table(&self, group: usize, request: &str) -> Option<&[u32]> {
        self.tables.get(&(group, request.to_string())).map(|v| v.as_slice())
    }
    fn num_cached(&self, _group: usize, _request: &str) -> usize {
        0
    }
    fn device(&mut self) -> &mut BlockPool {
        &mut self.device
    }
    fn host(&mut self) -> &mut BlockPool {
        &mut self.host
    }
    fn device_ref(&self) -> &BlockPool {
        &self.device
    }
    fn host_ref(&self) -> &BlockPool {
        &self.host
    }
    fn publish(&mut self, request: &str, num_tokens: usize) -> Result<()> {
        // cache the request's host blocks up to num_tokens under one key per page
        let table = self.tables.get(&(HOST, request.to_string())).cloned().unwrap_or_default();
        for (page, &b) in table.iter().enumerate().take(num_tokens / BS) {
            if self.host.block_key(b)?.is_none() {
                self.host.set_block_hash(b, Self::key(page), None)?;
                self.host.map_insert(Self::key(page), b)?;
            }
        }
        self.published.push((request.to_string(), num_tokens));
        Ok(())
    }
    fn publish_detached(&mut self, request: &str, blocks: &[u32], num_cached: usize, num_full: usize) -> Result<()> {
        self.detached.push((request.to_string(), blocks.to_vec(), num_cached, num_full));
        Ok(())
    }
}

fn layout(num_blocks: usize, max_model_len: usize, cap: usize) -> Layout {
    Layout {
        host_group: HOST,
        host_block_size: BS,
        resident_groups: vec![RESIDENT],
        resident_block_sizes: vec![BS],
        resident_admission_caps: vec![cap],
        hot_groups: vec![(HOT, 2)],
        num_blocks,
        max_model_len,
        num_reprefillable_tokens: 0,
        import_step_tokens: 0,
    }
}

/// A request holding `pages` host and resident pages.
fn admit(env: &mut TestEnv, request: &str, pages: usize) -> (Vec<u32>, Vec<u32>) {
    (env.grow(HOST, request, pages), env.grow(RESIDENT, request, pages))
}

fn complete_all(r: &mut Residency, env: &mut TestEnv) {
    let ids: Vec<(u64, usize)> = r.take_offload_command().unwrap().iter().map(|t| (t.transfer_id, 1)).collect();
    r.update_spills(env, &ids, &ids).unwrap();
}

#[test]
fn construction_checks_are_vllms() {
    let mut l = layout(32, 128, 8);
    l.host_group = 3;
    assert!(
        matches!(Residency::new(l), Err(Error::Value(m)) if m == "HiSparse host group must precede resident groups.")
    );
    let mut l = layout(32, 128, 8);
    l.resident_block_sizes = vec![32];
    assert!(
        matches!(Residency::new(l), Err(Error::Value(m)) if m == "HiSparse host and resident block sizes must match.")
    );
    let mut l = layout(32, 128, 8);
    l.resident_groups = vec![2, 4];
    l.resident_block_sizes = vec![16, 32];
    l.resident_admission_caps = vec![8, 8];
    assert!(
        matches!(Residency::new(l), Err(Error::Value(m)) if m == "HiSparse resident cache groups must use one block size.")
    );
    let r = Residency::new(layout(32, 128, 8)).unwrap();
    assert_eq!((r.max_spill_pages(), r.transition_watermark()), (8, 3)); // 128 // 16; max(2, 32 // 10)
}

#[test]
fn spill_then_clean_then_unpinned_then_lost() {
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 8)).unwrap();
    let (host, dev) = admit(&mut env, "r", 4);
    assert_eq!((host.clone(), dev.clone()), (vec![1, 2, 3, 4], vec![1, 2, 3, 4]));
    r.advance_scheduled(&mut env, &[("r", 64)]).unwrap();
    // every sealed page is planned: host and device blocks take a reference for the copy
    let spills = r.spills_to_send().to_vec();
    assert_eq!(
        spills.iter().map(|t| (t.transfer_id, t.host_block_id)).collect::<Vec<_>>(),
        vec![(0, 1), (1, 2), (2, 3), (3, 4)]
    );
    assert!(spills.iter().all(|t| t.after_forward && !t.restore));
    assert_eq!(env.host.ref_cnt(1).unwrap(), 2);
    assert_eq!(env.device.ref_cnt(1).unwrap(), 2);
    // plenty of free device blocks and under the admission window: no hot region asked for
    assert!(r.hot_required(0).is_empty());
    // enqueued by one worker, not completed yet: nothing changes
    let ids: Vec<(u64, usize)> = r.take_offload_command().unwrap().iter().map(|t| (t.transfer_id, 1)).collect();
    r.update_spills(&mut env, &ids, &[]).unwrap();
    assert_eq!(r.pending_spills().len(), 4);
    r.update_spills(&mut env, &[], &ids).unwrap();
    assert!(r.pending_spills().is_empty());
    assert_eq!((env.host.ref_cnt(1).unwrap(), env.device.ref_cnt(1).unwrap()), (1, 1));
    let st = r.request_state("r").unwrap();
    assert_eq!(st.valid_pages.iter().copied().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert_eq!(st.pinned_clean.len(), 4);
    assert_eq!(st.ready_prefix_pages, 4);
    // a hot region lets the request read from the host: clean sealed pages outside the
    // active tail are released, tail first, to the back of the free queue
    env.grow(HOT, "r", 2); // device blocks 5, 6
    r.update_residency(&mut env, "r").unwrap();
    let st = r.request_state("r").unwrap();
    assert_eq!(st.unpinned_pages.iter().copied().collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(st.pinned_clean.iter().copied().collect::<Vec<_>>(), vec![2, 3]);
    let q: Vec<u32> = env.device.free_queue().collect();
    assert_eq!(&q[q.len() - 2..], &[2, 1]);
    assert_eq!(r.get_residency_row(&env, 0, "r", 0), vec![1, 2, 3, 4]);
    // the worker learns the rows once
    let u = r.take_residency_updates(&env, &["r"]);
    assert_eq!(u, vec![("r".into(), ResidencyUpdate { pages: vec![0, 1, 2, 3], block_ids: vec![vec![1, 2, 3, 4]] })]);
    assert!(r.take_residency_updates(&env, &["r"]).is_empty());
    // the pool hands block 2 out: page 1 is lost, stale for the worker
    let n = env.device.num_free_blocks() - 1;
    let mut out = Vec::new();
    env.device.get_new_blocks(n, &mut out).unwrap();
    assert_eq!(*out.last().unwrap(), 2);
    let fired: Vec<u32> =
        env.device.take_fired_watchers().into_iter().filter(|&(_, w)| w == RESIDENCY_WATCHER).map(|(b, _)| b).collect();
    assert_eq!(fired, vec![2]);
    r.on_blocks_reused(&env, &fired);
    assert_eq!(r.get_residency_row(&env, 0, "r", 0), vec![1, 0, 3, 4]);
    assert_eq!(r.get_resident_page(&env, 0, "r", 1), None);
    let u = r.take_residency_updates(&env, &["r"]);
    assert_eq!(u, vec![("r".into(), ResidencyUpdate { pages: vec![1], block_ids: vec![vec![0]] })]);
    assert!(r.request_state("r").unwrap().unpinned_pages.contains(&0));
    env.device.check_invariants().unwrap();
}

#[test]
fn low_pool_or_full_window_asks_for_a_hot_region() {
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 3)).unwrap();
    admit(&mut env, "r", 2);
    r.update_residency(&mut env, "r").unwrap();
    assert!(r.hot_required(0).is_empty());
    env.grow(RESIDENT, "r", 1); // 3 pages: the admission window (cap 3) is full
    r.update_residency(&mut env, "r").unwrap();
    assert!(r.hot_required(0).contains("r"));
}

#[test]
fn spill_budget_is_max_model_len_in_pages() {
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 32, 8)).unwrap(); // 2 pages a step
    admit(&mut env, "r", 4);
    r.plan_prefix_materialization(&mut env, "r", 64).unwrap();
    assert_eq!(r.spills_to_send().iter().map(|t| t.host_block_id).collect::<Vec<_>>(), vec![1, 2]);
    r.plan_prefix_materialization(&mut env, "r", 64).unwrap(); // nothing sent yet: no budget left
    assert_eq!(r.spills_to_send().len(), 2);
    r.take_offload_command();
    r.plan_prefix_materialization(&mut env, "r", 64).unwrap();
    assert_eq!(r.spills_to_send().iter().map(|t| t.host_block_id).collect::<Vec<_>>(), vec![3, 4]);
}

#[test]
fn a_lowered_spill_budget_bounds_the_next_plan() {
    // vLLM's tests assign `coordinator.max_spill_pages = 1`; the watermark is as plain
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 8)).unwrap();
    r.set_max_spill_pages(1);
    r.set_transition_watermark(5);
    assert_eq!((r.max_spill_pages(), r.transition_watermark()), (1, 5));
    admit(&mut env, "r", 2);
    r.plan_prefix_materialization(&mut env, "r", 32).unwrap();
    let first = r.take_offload_command().unwrap();
    assert_eq!(first.iter().map(|t| t.host_block_id).collect::<Vec<_>>(), vec![1]);
    r.plan_prefix_materialization(&mut env, "r", 32).unwrap();
    let second = r.take_offload_command().unwrap();
    assert_eq!(second.iter().map(|t| t.host_block_id).collect::<Vec<_>>(), vec![2]);
    assert_ne!(first[0].transfer_id, second[0].transfer_id);
}

#[test]
fn a_hot_group_asked_directly_needs_a_region() {
    // vLLM's tests call `hot_manager.require_hot(request)` on every hot group; the request
    // then reads from the host once the region is allocated
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 8)).unwrap();
    admit(&mut env, "r", 4);
    r.require_hot(0, "r");
    assert!(r.hot_required(0).contains("r"));
    assert!(!r.has_hot(&env, 0, "r"));
    env.grow(HOT, "r", 2);
    assert!(r.has_hot(&env, 0, "r"));
    r.advance_scheduled(&mut env, &[("r", 64)]).unwrap();
    complete_all(&mut r, &mut env);
    // pages 0 and 1 are clean and released (2 and 3 are the active tail)
    assert_eq!(r.request_state("r").unwrap().unpinned_pages.iter().copied().collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
fn publication_follows_the_clean_prefix_and_records_device_copies() {
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 8)).unwrap();
    admit(&mut env, "a", 3);
    r.advance_scheduled(&mut env, &[("a", 48)]).unwrap();
    r.publish_when_ready(&mut env, "a", 48).unwrap();
    assert_eq!(env.published, vec![("a".to_string(), 0)]); // nothing durable yet
    complete_all(&mut r, &mut env);
    assert_eq!(env.published.last().unwrap(), &("a".to_string(), 48));
    assert!(r.request_state("a").unwrap().publication.is_none());
    assert_eq!(r.copies().len(), 3);
    assert_eq!(*r.copies()[&TestEnv::key(1)], [2]);
    // a second request hits the host prefix: its pages come back device-resident
    env.tables.insert((HOST, "b".into()), vec![1, 2]);
    env.host.touch(&[1, 2], true).unwrap();
    env.tables.insert((RESIDENT, "b".into()), vec![NULL_BLOCK, NULL_BLOCK]);
    r.commit_computed_blocks(&env, "b", 2);
    r.update_residency(&mut env, "b").unwrap();
    assert_eq!(r.get_residency_row(&env, 0, "b", 0), vec![1, 2]);
    assert_eq!(env.device.ref_cnt(1).unwrap(), 2);
    assert_eq!(r.request_state("b").unwrap().pinned_clean.iter().copied().collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
fn a_finished_request_keeps_its_host_blocks_until_its_spills_complete() {
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 8)).unwrap();
    admit(&mut env, "r", 2);
    r.advance_scheduled(&mut env, &[("r", 32)]).unwrap();
    r.publish_when_ready(&mut env, "r", 32).unwrap();
    r.free(&mut env, "r", true).unwrap();
    assert!(r.request_state("r").is_none());
    // the manager then frees the tables (one reference each); the copies still hold theirs
    env.host.free_blocks(&[2, 1], true).unwrap();
    env.device.free_blocks(&[2, 1], true).unwrap();
    env.tables.clear();
    assert_eq!((env.host.ref_cnt(1).unwrap(), env.host.ref_cnt(2).unwrap()), (2, 2)); // spill + detached
    assert!(r.has_pending_work());
    complete_all(&mut r, &mut env);
    assert_eq!(env.detached, vec![("r".to_string(), vec![1, 2], 0, 2)]);
    assert_eq!((env.host.ref_cnt(1).unwrap(), env.host.ref_cnt(2).unwrap()), (0, 0));
    assert_eq!(env.device.ref_cnt(1).unwrap(), 0);
    assert!(!r.has_pending_work());
    env.host.check_invariants().unwrap();
}

#[test]
fn a_preempted_request_drops_its_publication_and_releases_clean_pages() {
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 8)).unwrap();
    admit(&mut env, "r", 4);
    r.advance_scheduled(&mut env, &[("r", 64)]).unwrap();
    complete_all(&mut r, &mut env);
    r.free(&mut env, "r", false).unwrap();
    // clean pages stay readable copies: released to the pool, still in the table's row
    assert_eq!(env.device.ref_cnt(4).unwrap(), 0);
    assert!(env.device.has_watchers());
    assert!(r.request_state("r").is_none());
    assert_eq!(r.get_residency_row(&env, 0, "r", 0), vec![0, 0, 0, 0]);
}

#[test]
fn host_import_restores_its_last_page() {
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 8)).unwrap();
    env.grow(HOST, "r", 3);
    env.tables.insert((RESIDENT, "r".into()), vec![NULL_BLOCK, NULL_BLOCK]);
    env.grow(RESIDENT, "r", 1);
    r.record_pending_host_import("r", 40);
    r.plan_prefix_materialization(&mut env, "r", 48).unwrap(); // importing pages are skipped
    assert!(r.spills_to_send().is_empty());
    r.finish_host_import(&mut env, "r", false).unwrap();
    let t = r.spills_to_send().to_vec();
    assert_eq!(t.len(), 1);
    assert_eq!(
        (t[0].host_block_id, t[0].resident_block_ids.clone(), t[0].after_forward, t[0].restore),
        (3, vec![1], false, true)
    );
    assert_eq!(r.request_state("r").unwrap().ready_prefix_pages, 2);
}

#[test]
fn readers_stay_sorted_and_unique() {
    let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
    let mut r = Readers::default();
    r.insert(&b, 1);
    r.insert(&a, 7);
    r.insert(&b, 0);
    r.insert(&a, 7); // a repeat is kept once
    let order: Vec<(&str, usize)> = r.0.iter().map(|(q, p)| (&**q, *p)).collect();
    assert_eq!(order, [("a", 7), ("b", 0), ("b", 1)]);
    r.remove("b", 0);
    r.remove("c", 3); // absent: nothing changes
    let order: Vec<(&str, usize)> = r.0.iter().map(|(q, p)| (&**q, *p)).collect();
    assert_eq!(order, [("a", 7), ("b", 1)]);
}

#[test]
fn row_mirror_spans_match_the_per_page_lookup() {
    let mut env = TestEnv::new(32, 16);
    let mut r = Residency::new(layout(32, 128, 8)).unwrap();
    let (host, dev) = admit(&mut env, "r", 4);
    // page 1 is read from the host (the overlay's null block), page 3 has no host block
    assert_eq!(r.drop_resident_page(&env, 0, "r", 1), Some(dev[1]));
    env.tables.get_mut(&(HOST, "r".to_string())).unwrap()[3] = NULL_BLOCK;
    for (computed, scheduled) in [(8, 56), (0, 64), (17, 1), (20, 0), (60, 10), (0, 80)] {
        let mut spans = Vec::new();
        r.row_mirror_spans(&env, "r", computed, scheduled, |s| spans.push(s));
        let mut per_page = Vec::new();
        let host_table = env.table(HOST, "r").unwrap();
        r.spans_of(host_table, computed, scheduled, |page| r.resident_blocks(&env, "r", page), |s| per_page.push(s));
        assert_eq!(spans, per_page, "rows {computed}+{scheduled}");
    }
    let mirrors = r.build_row_mirrors(&env, &[("r", 8, 56), ("none", 0, 16)]);
    let expected = vec![
        RowMirror {
            source_starts: vec![dev[0] as usize * BS + 8],
            destination_start: host[0] as usize * BS + 8,
            num_rows: 8,
        },
        RowMirror { source_starts: vec![dev[2] as usize * BS], destination_start: host[2] as usize * BS, num_rows: 16 },
    ];
    assert_eq!(mirrors, expected);
}

#[test]
fn overlaid_rows_match_the_per_page_lookup() {
    // vLLM's get_residency_row: table[start..] with each page's overlay entry, if any
    let naive = |t: &[u32], o: Option<&BTreeMap<usize, u32>>, start: usize| -> Vec<u32> {
        (start..t.len()).map(|i| o.and_then(|o| o.get(&i).copied()).unwrap_or(t[i])).collect()
    };
    let table: Vec<u32> = vec![NULL_BLOCK, 7, 8, NULL_BLOCK, 9, 10];
    let overlays: Vec<BTreeMap<usize, u32>> = vec![
        BTreeMap::new(),
        [(1, NULL_BLOCK), (4, NULL_BLOCK)].into_iter().collect(),
        [(0, 21), (3, 22)].into_iter().collect(),
        // entries past the table are not part of the row
        [(2, NULL_BLOCK), (6, 30), (40, 31)].into_iter().collect(),
    ];
    for t in [&table[..], &table[..3], &[][..]] {
        for o in overlays.iter().map(Some).chain([None]) {
            for start in 0..8 {
                assert_eq!(overlaid_row(t, o, start), naive(t, o, start), "{t:?} {o:?} {start}");
            }
        }
    }
}

#[test]
fn all_context_pages_resident_reads_the_overlay() {
    let mut env = TestEnv::new(64, 64);
    let mut r = Residency::new(layout(64, 1024, 64)).unwrap();
    let (_, blocks) = admit(&mut env, "a", 3);
    let rows = [("a", 0usize, 3 * BS)];
    assert!(r.all_context_pages_resident(&env, &rows));
    // a dropped page reads from the host (the row has the null block there)
    r.resident_requests.clear();
    assert_eq!(r.drop_resident_page(&env, 0, "a", 1), Some(blocks[1]));
    assert!(r.get_residency_row(&env, 0, "a", 0).contains(&NULL_BLOCK));
    assert!(!r.all_context_pages_resident(&env, &rows));
    // adopting a block for it makes every page resident again
    assert!(r.adopt_resident_page(&env, 0, "a", 1, blocks[1]));
    assert!(!r.get_residency_row(&env, 0, "a", 0).contains(&NULL_BLOCK));
    assert!(r.all_context_pages_resident(&env, &rows));
}
