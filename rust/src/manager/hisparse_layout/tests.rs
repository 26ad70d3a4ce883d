//! The layout read from group kinds, and vLLM's `HiSparseCoordinator` configuration errors
//! (vLLM 0.33.0's `vllm/v1/hisparse/coordinator.py`).

use super::*;
use crate::hisparse::residency::Residency;
use crate::manager::spec::GroupSpec;

fn spec(kind: Kind, block_size: usize) -> GroupSpec {
    GroupSpec {
        kind,
        block_size,
        prefix_cacheable: matches!(kind, Kind::FullAttention | Kind::HiSparseSource),
        dcp_sharded: false,
        is_eagle_group: false,
        zeroed: false,
        spec_class: 0,
    }
}

fn config(groups: Vec<GroupSpec>) -> ManagerConfig {
    ManagerConfig {
        max_in_flight_tokens: 40,
        num_prefill_lookahead: 3,
        ..ManagerConfig::new(groups, 120, 256, 16, crate::manager::spec::Caller::Vllm)
    }
}

/// vLLM's test layout: source 0, indexer 1, resident 2, hot 3 (two blocks per request).
fn test_layout() -> Vec<GroupSpec> {
    vec![
        spec(Kind::HiSparseSource, 16),
        spec(Kind::FullAttention, 16),
        spec(Kind::HiSparseResident, 16),
        spec(Kind::HiSparseHot { blocks_per_request: 2 }, 16),
    ]
}

#[test]
fn vllms_test_layout_is_read_from_the_kinds() {
    let l = Layout::from_config(&config(test_layout()), Some(64), 8).unwrap().unwrap();
    assert_eq!(l.host_group, 0);
    assert_eq!(l.host_block_size, 16);
    assert_eq!(l.resident_groups, vec![2]);
    assert_eq!(l.resident_block_sizes, vec![16]);
    // cdiv(min(40, 256), 16)
    assert_eq!(l.resident_admission_caps, vec![3]);
    assert_eq!(l.hot_groups, vec![(3, 2)]);
    assert_eq!((l.num_blocks, l.max_model_len, l.num_reprefillable_tokens, l.import_step_tokens), (120, 256, 2, 8));
    let r = Residency::new(l).unwrap();
    // max(hot blocks per request, num_blocks // 10), max_model_len // block size
    assert_eq!(r.transition_watermark(), 12);
    assert_eq!(r.max_spill_pages(), 16);
}

#[test]
fn a_configuration_without_hisparse_groups_has_no_layout() {
    let c = config(vec![spec(Kind::FullAttention, 16)]);
    assert!(Layout::from_config(&c, None, 0).unwrap().is_none());
    assert!(Layout::from_config(&c, Some(8), 0).unwrap().is_none());
}

#[test]
fn vllms_configuration_errors_come_in_vllms_order() {
    let msg = |groups: Vec<GroupSpec>, host: Option<usize>| match Layout::from_config(&config(groups), host, 0) {
        Err(Error::Value(m)) => m,
        other => panic!("{other:?}"),
    };
    assert_eq!(msg(test_layout(), None), "HiSparse host group needs host capacity.");
    let mut two = test_layout();
    two.insert(1, spec(Kind::HiSparseSource, 16));
    assert_eq!(msg(two.clone(), Some(8)), "Only one HiSparse host group is supported.");
    // the first source group's capacity is checked before the second source is seen
    assert_eq!(msg(two, None), "HiSparse host group needs host capacity.");
    // resident groups without a source group: vLLM's assertion
    let orphan = vec![spec(Kind::FullAttention, 16), spec(Kind::HiSparseResident, 16)];
    assert!(matches!(Layout::from_config(&config(orphan), Some(8), 0), Err(Error::Assertion(_))));
    let hot_only = vec![spec(Kind::FullAttention, 16), spec(Kind::HiSparseHot { blocks_per_request: 1 }, 16)];
    assert!(matches!(Layout::from_config(&config(hot_only), Some(8), 0), Err(Error::NotImplemented(_))));
}

#[test]
fn the_residency_raises_the_rest_of_vllms_errors() {
    let err = |groups: Vec<GroupSpec>| {
        let l = Layout::from_config(&config(groups), Some(8), 0).unwrap().unwrap();
        match Residency::new(l) {
            Err(Error::Value(m)) => m,
            other => panic!("{other:?}"),
        }
    };
    let late_host = vec![spec(Kind::HiSparseResident, 16), spec(Kind::HiSparseSource, 16)];
    assert_eq!(err(late_host), "HiSparse host group must precede resident groups.");
    let mixed =
        vec![spec(Kind::HiSparseSource, 16), spec(Kind::HiSparseResident, 16), spec(Kind::HiSparseResident, 32)];
    assert_eq!(err(mixed), "HiSparse resident cache groups must use one block size.");
    let differ = vec![spec(Kind::HiSparseSource, 32), spec(Kind::HiSparseResident, 16)];
    assert_eq!(err(differ), "HiSparse host and resident block sizes must match.");
}
