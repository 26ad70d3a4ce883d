//! The manager behaviours that differ between the vLLM releases kvblock mirrors. The default
//! is vLLM 0.33's (and 0.34's); `kvblock.vllm.releases` turns on an older release's rules
//! when that release is installed. Nothing else in the core knows release numbers.

/// Release-dependent rules of the managers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleaseRules {
    /// A group flagged `is_eagle_group` drops the EAGLE block from its hits even with
    /// `use_eagle` off (vLLM 0.32's `eagle_group_ids`; from 0.33 only groups in
    /// `drop_eagle_group_ids`, which is empty without `use_eagle`, drop it).
    pub eagle_groups_drop_always: bool,
    /// A Mamba group in `mamba_cache_mode="none"` takes part in prefix caching (vLLM 0.32;
    /// from 0.33 `MambaManager` asserts that prefix caching uses "align").
    pub mamba_none_mode_caches: bool,
    /// `MambaManager._cache_partial_tail_block` registers the prompt's last boundary state
    /// again when its block already carries that key, which marks it cached this step
    /// (vLLM 0.32; from 0.33 an already keyed block is left alone).
    pub partial_tail_rekeyed: bool,
    /// The base `cache_blocks` also retains the block before a shared-prefix junction under
    /// EAGLE (`shared_prefix_boundary - block_size`; vLLM 0.33+, not 0.32).
    pub eagle_junction_block_retained: bool,
    /// `HiSparseResidentManager.pop_blocks_for_free` trims the row's null head (vLLM 0.33+,
    /// `trim_null_head`); 0.32 returns the row whole.
    pub hisparse_trim_null_head: bool,
}

impl Default for ReleaseRules {
    /// vLLM 0.33's rules (0.34 has the same).
    fn default() -> Self {
        ReleaseRules {
            eagle_groups_drop_always: false,
            mamba_none_mode_caches: false,
            partial_tail_rekeyed: false,
            eagle_junction_block_retained: true,
            hisparse_trim_null_head: true,
        }
    }
}
