//! The HiSparse groups' rules against the counts vLLM's `HiSparseSourceManager`,
//! `HiSparseResidentManager` and `HiSparseHotManager` compute (worked by hand from vLLM
//! 0.33.0 and 0.34.0's `single_type_kv_cache_manager.py`).

use std::collections::BTreeMap;

use super::*;
use crate::error::Error;
use crate::manager::spec::{GroupSpec, Kind, ManagerConfig};

const BS: usize = 4;

fn spec(kind: Kind) -> GroupSpec {
    GroupSpec {
        kind,
        block_size: BS,
        prefix_cacheable: matches!(kind, Kind::HiSparseSource),
        dcp_sharded: false,
        is_eagle_group: false,
        zeroed: false,
        spec_class: 0,
    }
}

/// A group config as vLLM builds it: `max_in_flight_tokens` 8, `max_model_len` 64.
fn cfg(kind: Kind) -> TypeConfig {
    TypeConfig::new(spec(kind), 0, true, BS, 1, 1, false, 8, 64, crate::manager::release::ReleaseRules::default())
}

fn manager_config(groups: Vec<GroupSpec>) -> ManagerConfig {
    ManagerConfig {
        max_in_flight_tokens: 8,
        ..ManagerConfig::new(groups, 16, 64, BS, crate::manager::spec::Caller::Vllm)
    }
}

#[test]
fn the_resident_admission_cap_is_the_in_flight_tokens_in_pages() {
    // cdiv(min(max_in_flight_tokens, max_model_len), block_size)
    assert_eq!(cfg(Kind::HiSparseResident).max_admission_blocks, Some(2));
    assert_eq!(spec(Kind::HiSparseResident).max_admission_blocks(100, 10), Some(3));
    assert_eq!(cfg(Kind::HiSparseHot { blocks_per_request: 3 }).max_admission_blocks, None);
    assert_eq!(cfg(Kind::HiSparseSource).max_admission_blocks, None);
}

#[test]
fn the_kinds_look_up_hits_as_vllm_classes_do() {
    assert!(Kind::HiSparseSource.is_full_attention());
    assert!(Kind::HiSparseSource.supports_fine_grained_hash_lookup());
    assert!(!Kind::HiSparseResident.is_full_attention());
    assert!(!Kind::HiSparseHot { blocks_per_request: 1 }.supports_fine_grained_hash_lookup());
    assert!(Kind::HiSparseHot { blocks_per_request: 1 }.is_hisparse());
    assert!(!Kind::FullAttention.is_hisparse());
}

#[test]
fn a_manager_config_with_hisparse_groups_passes_validation_and_checks_its_host_size() {
    let mut c = manager_config(vec![spec(Kind::HiSparseSource), spec(Kind::HiSparseResident)]);
    assert!(c.validate().is_ok());
    c.hisparse_host_num_blocks = Some(0);
    assert!(matches!(c.validate(), Err(Error::Value(m)) if m.contains("hisparse_host_num_blocks")));
    // hot groups without a host group: the tier refuses them when the manager is built
    let full = GroupSpec { prefix_cacheable: true, ..spec(Kind::FullAttention) };
    let c = manager_config(vec![full, spec(Kind::HiSparseHot { blocks_per_request: 2 })]);
    assert!(c.validate().is_ok());
    let e = crate::manager::KVCacheManager::new(&c).unwrap_err();
    assert!(matches!(e, Error::NotImplemented(m) if m.contains("without a HiSparse host group")));
    // a group's own bad value: vLLM's callers (this config's caller) get vLLM's assert
    let mut c = manager_config(vec![spec(Kind::HiSparseHot { blocks_per_request: 0 })]);
    assert!(matches!(c.validate(), Err(Error::Assertion(m)) if m.contains("blocks_per_request")));
    c.caller = crate::manager::spec::Caller::Kvblock;
    assert!(matches!(c.validate(), Err(Error::Value(m)) if m.contains("blocks_per_request")));
}

#[test]
fn resident_counts_skip_host_pages_and_cap_admission() {
    let c = cfg(Kind::HiSparseResident);
    let st = ReqState::default();
    // a new request, 10 tokens: 3 pages, capped at 2
    assert_eq!(resident_num_blocks_to_allocate(&c, &st, None, 10, 0, 0, false), 3);
    assert_eq!(resident_num_blocks_to_allocate(&c, &st, None, 10, 0, 0, true), 2);
    // a 5-token host-prefix hit: its 2 pages stay on the host
    assert_eq!(resident_num_blocks_to_allocate(&c, &st, None, 10, 5, 5, false), 1);
    let mut st = ReqState::default();
    assert_eq!(resident_add_local_computed_blocks(&c, &mut st, 5).unwrap(), 2);
    assert_eq!(st.blocks, vec![NULL_BLOCK, NULL_BLOCK]);
    assert_eq!(st.num_cached, Some(0));
    assert_eq!(resident_num_blocks_to_allocate(&c, &st, None, 10, 5, 5, false), 1);
    let mut pool = BlockPool::new(8, true, BS, false).unwrap();
    let got = resident_allocate_new_blocks(&c, &mut pool, &mut st, 10).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(st.blocks[2], got[0]);
    assert!(resident_allocate_new_blocks(&c, &mut pool, &mut st, 12).unwrap().is_empty());
    // a second host-prefix hit on a request with blocks is vLLM's assertion, nothing changed
    let before = st.blocks.clone();
    assert!(matches!(resident_add_local_computed_blocks(&c, &mut st, 4), Err(Error::Assertion(_))));
    assert_eq!(st.blocks, before);
}

#[test]
fn an_import_keeps_only_its_last_page_writable() {
    let c = cfg(Kind::HiSparseResident);
    let mut pool = BlockPool::new(8, true, BS, false).unwrap();
    let mut st = ReqState::default();
    // 4 local + 5 external tokens, 13 scheduled: pages 0..3 imported, page 2 the tail
    assert_eq!(resident_num_blocks_to_allocate(&c, &st, None, 13, 9, 4, true), 1 + 1);
    assert_eq!(resident_external_blocks_needed(&c, &st, None, 4, 5), 1);
    resident_allocate_external_computed_blocks(&c, &mut pool, &mut st, None, 4, 5).unwrap();
    assert_eq!(st.blocks.len(), 3);
    assert_eq!(&st.blocks[..2], &[NULL_BLOCK, NULL_BLOCK]);
    let tail = st.blocks[2];
    assert_ne!(tail, NULL_BLOCK);
    assert_eq!(resident_page(&st, None, 2), Some(tail));
    // the tail is resident now: only the page past the import
    assert_eq!(resident_num_blocks_to_allocate(&c, &st, None, 13, 9, 4, true), 1);
    assert_eq!(resident_external_blocks_needed(&c, &st, None, 4, 5), 0);
    // the residency dropped the tail (vLLM's `drop_resident_page`): it needs a block again
    let dropped: BTreeMap<usize, u32> = [(2, NULL_BLOCK)].into();
    assert_eq!(resident_page(&st, Some(&dropped), 2), None);
    assert_eq!(resident_num_blocks_to_allocate(&c, &st, Some(&dropped), 13, 9, 4, true), 2);
    // no external tokens: vLLM's assertion, nothing changed
    let before = (st.blocks.clone(), pool.num_free_blocks());
    assert!(resident_allocate_external_computed_blocks(&c, &mut pool, &mut st, None, 4, 0).is_err());
    assert_eq!((st.blocks.clone(), pool.num_free_blocks()), before);
}

#[test]
fn an_exhausted_device_pool_leaves_the_resident_row_unchanged() {
    let c = cfg(Kind::HiSparseResident);
    let mut pool = BlockPool::new(2, true, BS, false).unwrap(); // one free block
    let mut st = ReqState::default();
    assert!(resident_allocate_new_blocks(&c, &mut pool, &mut st, 8).is_err());
    assert!(!st.present && st.blocks.is_empty());
    assert_eq!(pool.num_free_blocks(), 1);
    let mut st = ReqState::default();
    resident_allocate_external_computed_blocks(&c, &mut pool, &mut st, None, 0, 4).unwrap();
    assert_eq!(pool.num_free_blocks(), 0);
    let before = st.blocks.clone();
    assert!(resident_allocate_external_computed_blocks(&c, &mut pool, &mut st, None, 4, 4).is_err());
    assert_eq!(st.blocks, before);
}

#[test]
fn freeing_a_resident_row_returns_it_with_the_overlay_applied() {
    let mut st = ReqState::default();
    st.table().extend_from_slice(&[NULL_BLOCK, NULL_BLOCK, 5, 6]);
    st.num_cached = Some(0);
    // page 2 was dropped (reclaimed), page 0 adopted a GPU copy
    let overlay: BTreeMap<usize, u32> = [(0, 9), (2, NULL_BLOCK)].into();
    assert_eq!(residency_row(&st, Some(&overlay), 0), vec![9, NULL_BLOCK, NULL_BLOCK, 6]);
    assert_eq!(residency_row(&st, Some(&overlay), 3), vec![6]);
    assert_eq!(residency_row(&st, None, 1), vec![NULL_BLOCK, 5, 6]);
    assert!(residency_row(&st, None, 9).is_empty());
    let only_dropped: BTreeMap<usize, u32> = [(2, NULL_BLOCK)].into();
    let mut st2 = st.clone();
    // 0.33 and 0.34 trim the null head, 0.32 returns the row whole
    assert_eq!(resident_pop_blocks_for_free(&mut st, Some(&only_dropped), true), vec![6]);
    assert!(!st.present && st.blocks.is_empty() && st.num_cached.is_none());
    assert_eq!(
        resident_pop_blocks_for_free(&mut st2, Some(&only_dropped), false),
        vec![NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 6]
    );
}

#[test]
fn the_source_group_answers_zero_or_the_admission_sentinel() {
    let c = cfg(Kind::HiSparseSource);
    let host = BlockPool::new(4, true, BS, false).unwrap(); // 3 free host blocks
    let st = ReqState::default();
    let count = |n, total, local, cap, step| {
        source_num_blocks_to_allocate(&c, &host, &st, n, &[], total, local, cap, 100, step).unwrap()
    };
    // 3 host blocks back 12 tokens; 13 need 4: the device pool's size + 1
    assert_eq!(count(12, 0, 0, true, None), SourceCount { blocks: 0, size_import: None });
    assert_eq!(count(13, 0, 0, true, None), SourceCount { blocks: 101, size_import: None });
    // the base count takes no admission cap: a capped 13-token request still needs 4
    assert_eq!(count(13, 0, 0, true, None).blocks, 101);
    // 0.34: a capped import is sized import_step_tokens further; reserved pages are not free
    let step = Some(ImportStep { import_step_tokens: 4, reserved_import_pages: 1 });
    assert_eq!(count(8, 8, 4, true, step), SourceCount { blocks: 101, size_import: Some(3) });
    assert_eq!(count(4, 8, 4, true, step), SourceCount { blocks: 0, size_import: Some(2) });
    // uncapped, or no import: 0.33's count
    assert_eq!(count(8, 8, 4, false, step), SourceCount { blocks: 0, size_import: None });
    assert_eq!(count(12, 0, 0, true, step), SourceCount { blocks: 0, size_import: None });
}

#[test]
fn the_hot_region_comes_only_with_host_backed_history() {
    let mut pool = BlockPool::new(8, true, BS, false).unwrap();
    let mut st = ReqState::default();
    // a cold new request: nothing
    assert_eq!(hot_num_blocks_to_allocate(&st, 3, false, 0, 0), 0);
    // an import, a new request resuming a host prefix, or hot_required: the whole region
    assert_eq!(hot_num_blocks_to_allocate(&st, 3, false, 8, 4), 3);
    assert_eq!(hot_num_blocks_to_allocate(&st, 3, false, 4, 4), 3);
    assert_eq!(hot_num_blocks_to_allocate(&st, 3, true, 0, 0), 3);
    // a cold admission runs without a region and without a table
    assert!(hot_allocate_new_blocks(&mut pool, &mut st, 3, false).unwrap().is_empty());
    assert_eq!(st.num_cached, Some(0));
    assert!(!st.present);
    // running now: a local prefix no longer asks for a region
    assert_eq!(hot_num_blocks_to_allocate(&st, 3, false, 4, 4), 0);
    assert!(!hot_has_hot(&st, 3));
    let got = hot_allocate_new_blocks(&mut pool, &mut st, 3, true).unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(st.blocks, got);
    assert!(hot_has_hot(&st, 3));
    assert_eq!(hot_num_required_blocks(&st, 3), 0);
    assert!(hot_allocate_new_blocks(&mut pool, &mut st, 3, true).unwrap().is_empty());
    // an exhausted pool: the error, nothing taken
    let mut small = BlockPool::new(2, true, BS, false).unwrap();
    let mut st = ReqState::default();
    assert!(hot_allocate_new_blocks(&mut small, &mut st, 3, true).is_err());
    assert!(!st.present && st.blocks.is_empty());
    assert_eq!(small.num_free_blocks(), 1);
}

#[test]
fn a_host_prefix_hit_or_no_resident_group_requires_a_hot_region() {
    let mut st = ReqState::default();
    assert!(hot_add_local_computed_blocks(&mut st, 4, true));
    assert_eq!(st.num_cached, Some(0));
    assert!(!hot_add_local_computed_blocks(&mut ReqState::default(), 0, true));
    assert!(hot_add_local_computed_blocks(&mut ReqState::default(), 0, false));
}
