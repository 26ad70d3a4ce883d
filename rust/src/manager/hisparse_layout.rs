//! The HiSparse layout of a manager configuration: which group is the host (source) group,
//! which are resident and hot, read from the group kinds as vLLM's `HiSparseCoordinator`
//! constructor reads them from its managers, with vLLM's configuration errors.

use crate::error::{Error, Result};
use crate::hisparse::residency::Layout;
use crate::manager::spec::{Kind, ManagerConfig};

impl Layout {
    /// The layout of `cfg`'s HiSparse groups, None if it has none.
    ///
    /// `hisparse_host_num_blocks` is `kv_cache_config.hisparse_host_num_blocks`;
    /// `import_step_tokens` is 0.34's (0 before). Block sizes are the managers' (DCP-scaled).
    /// The coordinator's `num_reprefillable_tokens` is `num_prefill_lookahead - 1`.
    ///
    /// Errors, in vLLM's order (the constructor walks the groups once for the source group):
    /// a source group with no host capacity, `ValueError("HiSparse host group needs host
    /// capacity.")`; a second source group, `ValueError("Only one HiSparse host group is
    /// supported.")`; resident groups with no source group, an `AssertionError` as vLLM's
    /// `assert self.host_manager is not None`. [`crate::hisparse::residency::Residency::new`]
    /// raises the rest (group order, block sizes).
    pub fn from_config(
        cfg: &ManagerConfig,
        hisparse_host_num_blocks: Option<usize>,
        import_step_tokens: usize,
    ) -> Result<Option<Layout>> {
        if !cfg.groups.iter().any(|g| g.kind.is_hisparse()) {
            return Ok(None);
        }
        let block_size = |i: usize| cfg.groups[i].block_size * cfg.dcp_of(&cfg.groups[i]);
        let mut resident_groups = Vec::new();
        let mut hot_groups = Vec::new();
        for (i, g) in cfg.groups.iter().enumerate() {
            match g.kind {
                Kind::HiSparseResident => resident_groups.push(i),
                Kind::HiSparseHot { blocks_per_request } => hot_groups.push((i, blocks_per_request)),
                _ => {}
            }
        }
        let mut host_group = None;
        for (i, g) in cfg.groups.iter().enumerate() {
            if g.kind == Kind::HiSparseSource {
                if host_group.is_some() {
                    return Err(Error::Value("Only one HiSparse host group is supported.".into()));
                }
                if hisparse_host_num_blocks.is_none() {
                    return Err(Error::Value("HiSparse host group needs host capacity.".into()));
                }
                host_group = Some(i);
            }
        }
        let host_group = match host_group {
            Some(h) => h,
            None if resident_groups.is_empty() => {
                // hot groups alone: vLLM binds them to a coordinator without a host tier;
                // kvblock's residency needs a host group to hang its books on
                return Err(Error::NotImplemented(
                    "HiSparse hot groups without a HiSparse host group are not supported by kvblock".into(),
                ));
            }
            None => {
                return Err(Error::Assertion("HiSparse resident groups need a HiSparse host group".into()));
            }
        };
        Ok(Some(Layout {
            host_group,
            host_block_size: block_size(host_group),
            resident_block_sizes: resident_groups.iter().map(|&i| block_size(i)).collect(),
            resident_admission_caps: resident_groups
                .iter()
                .map(|&i| cfg.groups[i].max_admission_blocks(cfg.max_in_flight_tokens, cfg.max_model_len).unwrap_or(0))
                .collect(),
            resident_groups,
            hot_groups,
            num_blocks: cfg.num_blocks,
            max_model_len: cfg.max_model_len,
            num_reprefillable_tokens: cfg.num_prefill_lookahead.saturating_sub(1),
            import_step_tokens,
        }))
    }
}

#[cfg(test)]
#[path = "hisparse_layout/tests.rs"]
mod tests;
