//! vLLM's `SingleTypeKVCacheManager`: the manager of one KV-cache group, with the behaviour
//! every group kind shares (spec §5.3 steps 7–12, §6.2). The kind-specific parts live in the
//! files named after the kinds; [`TypeManager`] dispatches to them.
//!
//! Requests are addressed by a *slot* the owner (the coordinator) resolves once per call; the
//! per-request state of this group is `reqs[slot]`. vLLM keeps `req_to_blocks` as a
//! `defaultdict`: merely reading a request's list creates it. `ReqState::present` mirrors that,
//! so the Python view of `req_to_blocks` holds exactly vLLM's keys.

use crate::error::{Error, Result};
use crate::hashing::source::{HashSource, ScaledHashes};
use crate::manager::group_state::{
    cdiv, table_index, Hit, HitQuery, ReqInfo, ReqState, TypeConfig, TypeManager, TypeState,
};
use crate::manager::release::ReleaseRules;
use crate::manager::spec::{GroupSpec, Kind, MambaMode};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};

impl TypeConfig {
    /// A manager configuration for group `group_id` (vLLM's `get_manager_for_kv_cache_spec`).
    #[allow(clippy::too_many_arguments)] // vLLM's manager constructor arguments
    pub fn new(
        spec: GroupSpec,
        group_id: u32,
        enable_caching: bool,
        scheduler_block_size: usize,
        dcp_world_size: usize,
        pcp_world_size: usize,
        needs_kv_cache_zeroing: bool,
        max_in_flight_tokens: usize,
        max_model_len: usize,
        rules: ReleaseRules,
    ) -> Self {
        let (dcp, pcp) = if spec.dcp_sharded { (dcp_world_size, pcp_world_size) } else { (1, 1) };
        TypeConfig {
            block_size: spec.block_size * dcp,
            dcp_world_size: dcp,
            pcp_world_size: pcp,
            scheduler_block_size,
            cache_hit_alignment_tokens: scheduler_block_size,
            enable_caching,
            max_admission_blocks: spec.max_admission_blocks(max_in_flight_tokens, max_model_len),
            record_new_block_ids: needs_kv_cache_zeroing && spec.zeroed,
            use_eagle: false,
            shared_prefix_checkpoint: false,
            drop_eagle_checkpoint_block: false,
            rules,
            group_id,
            spec,
        }
    }

    #[inline]
    pub fn is_mamba_align(&self) -> bool {
        matches!(self.spec.kind, Kind::Mamba { mode: MambaMode::Align, .. })
    }

    /// `_get_num_evictable_blocks`.
    pub fn num_evictable(pool: &BlockPool, blocks: &[u32]) -> usize {
        pool.count_free(blocks)
    }

    /// `_has_partial_local_hit`.
    #[inline]
    pub fn has_partial_local_hit(&self, new_computed: &[u32], num_local_computed: usize) -> bool {
        !new_computed.is_empty() && !num_local_computed.is_multiple_of(self.block_size)
    }

    /// `get_num_skipped_tokens`.
    pub fn num_skipped_tokens(&self, n: usize) -> usize {
        match self.spec.kind {
            Kind::SlidingWindow { window, extra_retained_tokens } => {
                (n + 1).saturating_sub(window).saturating_sub(extra_retained_tokens)
            }
            Kind::ChunkedLocal { chunk } => n / chunk * chunk,
            Kind::Mamba { .. } => n.saturating_sub(1),
            _ => 0,
        }
    }

    /// The base `get_num_blocks_to_allocate`.
    #[allow(clippy::too_many_arguments)] // vLLM's signature
    pub fn base_num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        st: &ReqState,
        num_tokens: usize,
        new_computed: &[u32],
        total_computed: usize,
        num_local_computed: usize,
        apply_admission_cap: bool,
    ) -> Result<usize> {
        let mut required = cdiv(num_tokens, self.block_size);
        if apply_admission_cap {
            if let Some(cap) = self.max_admission_blocks {
                required = required.min(cap);
            }
        }
        let num_req_blocks = if st.present { st.blocks.len() } else { 0 };
        if st.num_cached.is_some() {
            // a running request has no new prefix-cache hits
            if !new_computed.is_empty() {
                return Err(Error::Assertion("a running request cannot adopt new computed blocks".into()));
            }
            return Ok(required.saturating_sub(num_req_blocks));
        }
        let skipped_blocks = self.num_skipped_tokens(total_computed) / self.block_size;
        let local_blocks = new_computed.len() + num_req_blocks;
        let mut num_new = required.saturating_sub(skipped_blocks.max(local_blocks));
        let skipped_new_computed = skipped_blocks.saturating_sub(num_req_blocks).min(new_computed.len());
        let evictable = Self::num_evictable(pool, &new_computed[skipped_new_computed..]);
        if self.has_partial_local_hit(new_computed, num_local_computed) {
            num_new += 1;
        }
        Ok(num_new + evictable)
    }

    /// The base `add_local_computed_blocks`.
    pub fn base_add_local_computed_blocks(
        &self,
        pool: &mut BlockPool,
        st: &mut ReqState,
        new_computed: &[u32],
        num_local_computed: usize,
        num_external_computed: usize,
    ) -> Result<()> {
        if !st.table().is_empty() {
            return Err(Error::Assertion("add_local_computed_blocks: the request already has blocks".into()));
        }
        let skipped_blocks = self.num_skipped_tokens(num_local_computed + num_external_computed) / self.block_size;
        let kept = &new_computed[skipped_blocks.min(new_computed.len())..];
        if self.enable_caching {
            pool.touch(kept, true)?;
        } else if !kept.is_empty() {
            return Err(Error::Assertion("Computed blocks should be empty when prefix caching is disabled".into()));
        }
        st.blocks.extend(std::iter::repeat_n(NULL_BLOCK, skipped_blocks));
        st.blocks.extend_from_slice(kept);
        st.num_cached = Some(st.blocks.len());
        if self.has_partial_local_hit(kept, num_local_computed) {
            let block_idx = num_local_computed / self.block_size;
            st.partial_hit = kept.last().map(|&b| (table_index(block_idx), b));
            st.num_cached = Some(block_idx);
        }
        Ok(())
    }

    /// Blocks the base `allocate_external_computed_blocks` would take.
    pub fn external_blocks_needed(&self, st: &ReqState, num_local_computed: usize, num_external: usize) -> usize {
        let total = num_local_computed + num_external;
        let skipped = self.num_skipped_tokens(total);
        let ext = if skipped > 0 { (total - skipped).min(num_external) } else { num_external };
        if ext == 0 {
            return 0;
        }
        cdiv(total, self.block_size).saturating_sub(if st.present { st.blocks.len() } else { 0 })
    }

    /// The base `allocate_external_computed_blocks`.
    pub fn base_allocate_external_computed_blocks(
        &self,
        pool: &mut BlockPool,
        ts: &mut TypeState,
        st: &mut ReqState,
        num_local_computed: usize,
        num_external: usize,
        record_for_zeroing: bool,
    ) -> Result<()> {
        let total = num_local_computed + num_external;
        let skipped = self.num_skipped_tokens(total);
        let ext = if skipped > 0 { (total - skipped).min(num_external) } else { num_external };
        if ext == 0 {
            return Ok(());
        }
        let n = cdiv(total, self.block_size).saturating_sub(st.table().len());
        let start = st.blocks.len();
        pool.get_new_blocks(n, &mut st.blocks)?;
        if self.record_new_block_ids && record_for_zeroing {
            ts.new_block_ids.extend_from_slice(&st.blocks[start..]);
        }
        Ok(())
    }

    /// `_apply_cow`: the request's block `block_idx` (`source`) becomes `cow`; both stay
    /// retained until the copy ran (`cow` takes an extra reference).
    pub fn apply_cow(
        &self,
        pool: &mut BlockPool,
        ts: &mut TypeState,
        st: &mut ReqState,
        block_idx: usize,
        source: u32,
        cow: u32,
    ) -> Result<()> {
        if block_idx >= st.blocks.len() || st.blocks[block_idx] != source {
            return Err(Error::Assertion("_apply_cow: the partial-hit block is not in place".into()));
        }
        if source == NULL_BLOCK || pool.ref_of(source) == 0 {
            return Err(Error::Assertion("_apply_cow: the source block is not held".into()));
        }
        st.blocks[block_idx] = cow;
        ts.pending_cow.push((source, cow));
        pool.set_ref_cnt(cow, pool.ref_of(cow) + 1)
    }

    /// Blocks the base `allocate_new_blocks` would take.
    pub fn new_blocks_needed(&self, st: &ReqState, num_tokens: usize) -> usize {
        let cow = st.partial_hit.is_some() as usize;
        cow + cdiv(num_tokens, self.block_size).saturating_sub(if st.present { st.blocks.len() } else { 0 })
    }

    /// The base `allocate_new_blocks`: the new blocks (a partial hit's copy first).
    pub fn base_allocate_new_blocks(
        &self,
        pool: &mut BlockPool,
        ts: &mut TypeState,
        st: &mut ReqState,
        num_tokens: usize,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if let Some((block_idx, source)) = st.partial_hit.take() {
            let mut cow = Vec::with_capacity(1);
            pool.get_new_blocks(1, &mut cow)?;
            self.apply_cow(pool, ts, st, block_idx as usize, source, cow[0])?;
            ts.new_block_ids.push(cow[0]);
            out.push(cow[0]);
        }
        let have = st.table().len();
        let required = cdiv(num_tokens, self.block_size);
        if required > have {
            let start = out.len();
            pool.get_new_blocks(required - have, &mut out)?;
            st.blocks.extend_from_slice(&out[start..]);
            if self.record_new_block_ids {
                ts.new_block_ids.extend_from_slice(&out[start..]);
            }
        }
        Ok(out)
    }

    /// The base `cache_blocks`: cache the request's full blocks up to `num_tokens` (masked by
    /// the kind's `reachable_block_mask`).
    #[allow(clippy::too_many_arguments)] // vLLM's signature
    pub fn base_cache_blocks(
        &self,
        pool: &mut BlockPool,
        st: &mut ReqState,
        req: &ReqInfo<'_>,
        hashes: &dyn HashSource,
        num_tokens: usize,
        retention_interval: Option<usize>,
        replay_boundaries: &[usize],
    ) -> Result<()> {
        if !self.spec.prefix_cacheable {
            return Ok(());
        }
        let num_cached = st.num_cached.unwrap_or(0);
        let hashed = hashes.len() * pool.hash_block_size();
        let num_full = num_tokens.min(hashed) / self.block_size;
        if num_cached >= num_full {
            return Ok(());
        }
        let mask = self.cache_mask(req, num_cached, num_full, retention_interval, replay_boundaries);
        let view = ScaledHashes::new(hashes, pool.hash_block_size(), self.block_size)?;
        let table = st.table();
        // vLLM slices the table, so a range past its end caches the blocks there are
        let end = num_full.min(table.len().max(num_cached));
        pool.cache_full_blocks(
            table,
            num_cached,
            end,
            &view,
            self.block_size,
            self.group_id,
            mask.as_deref(),
            req.event_tag,
        )?;
        st.num_cached = Some(num_full);
        Ok(())
    }

    /// The `block_mask` the base `cache_blocks` passes `cache_full_blocks` for caching blocks
    /// `[num_cached, num_full)` of `req` (None: every block): the kind's
    /// `reachable_block_mask` at the group's alignment, with the request's shared-prefix
    /// junction among the replay boundaries.
    pub fn cache_mask(
        &self,
        req: &ReqInfo<'_>,
        num_cached: usize,
        num_full: usize,
        retention_interval: Option<usize>,
        replay_boundaries: &[usize],
    ) -> Option<Vec<bool>> {
        let mut boundaries = crate::manager::coordinator::Boundaries::from_slice(replay_boundaries);
        if req.shared_prefix_boundary > 0 {
            boundaries.push(req.shared_prefix_boundary);
            if self.use_eagle && self.rules.eagle_junction_block_retained {
                boundaries.push(req.shared_prefix_boundary.saturating_sub(self.block_size));
            }
        }
        self.reachable_block_mask(
            num_cached,
            num_full,
            Some(self.cache_hit_alignment_tokens),
            self.use_eagle,
            retention_interval,
            &boundaries,
            None,
        )
    }

    /// `reachable_block_mask` (None: every block).
    #[allow(clippy::too_many_arguments)] // vLLM's signature
    pub fn reachable_block_mask(
        &self,
        start_block: usize,
        end_block: usize,
        alignment_tokens: Option<usize>,
        use_eagle: bool,
        retention_interval: Option<usize>,
        reachable_boundaries: &[usize],
        final_segment_end_block: Option<usize>,
    ) -> Option<Vec<bool>> {
        match self.spec.kind {
            Kind::SlidingWindow { window, .. } => crate::manager::sliding_window::reachable_block_mask(
                window,
                self.spec.block_size * self.dcp_world_size,
                start_block,
                end_block,
                alignment_tokens,
                use_eagle,
                retention_interval,
                reachable_boundaries,
                final_segment_end_block,
            ),
            Kind::Mamba { .. } => crate::manager::mamba::reachable_block_mask(
                self.spec.block_size,
                start_block,
                end_block,
                alignment_tokens,
                retention_interval,
                reachable_boundaries,
            ),
            _ => None,
        }
    }

    /// The base `_remove_blocks_in_range`: null and free blocks `[first, last)`, walking back
    /// from `last` and stopping at the first null block.
    pub fn base_remove_blocks_in_range(
        &self,
        pool: &mut BlockPool,
        st: &mut ReqState,
        first: usize,
        last: usize,
    ) -> Result<()> {
        if !st.present || first >= last {
            return Ok(());
        }
        let last = last.min(st.blocks.len());
        let mut freed = Vec::new();
        let mut i = last;
        while i > first {
            i -= 1;
            if st.blocks[i] == NULL_BLOCK {
                break;
            }
            freed.push(st.blocks[i]);
        }
        if !freed.is_empty() {
            pool.free_blocks(&freed, true)?;
            for b in &mut st.blocks[last - freed.len()..last] {
                *b = NULL_BLOCK;
            }
        }
        Ok(())
    }

    /// The base `remove_skipped_blocks`.
    pub fn base_remove_skipped_blocks(
        &self,
        pool: &mut BlockPool,
        st: &mut ReqState,
        processed_computed_tokens: usize,
    ) -> Result<()> {
        let skipped = self.num_skipped_tokens(processed_computed_tokens);
        if skipped == 0 {
            return Ok(());
        }
        let n = (skipped / self.block_size).min(st.table().len());
        self.remove_blocks_in_range(pool, st, 0, n)
    }

    /// `_remove_blocks_in_range` of the kind.
    pub fn remove_blocks_in_range(
        &self,
        pool: &mut BlockPool,
        st: &mut ReqState,
        first: usize,
        last: usize,
    ) -> Result<()> {
        if self.is_mamba_align() {
            crate::manager::mamba::remove_blocks_in_range(pool, st, first, last)
        } else {
            self.base_remove_blocks_in_range(pool, st, first, last)
        }
    }

    /// The base `pop_blocks_for_free`: the table without its leading null blocks; the request
    /// is forgotten.
    pub fn base_pop_blocks_for_free(&self, st: &mut ReqState) -> Vec<u32> {
        let blocks = std::mem::take(&mut st.blocks);
        st.present = false;
        st.num_cached = None;
        st.partial_hit = None;
        let lead = blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
        if lead == 0 {
            blocks
        } else {
            blocks[lead..].to_vec()
        }
    }
}

impl TypeManager {
    /// A manager with no requests.
    pub fn new(cfg: TypeConfig) -> Self {
        TypeManager { cfg, st: TypeState::default(), reqs: Vec::new() }
    }

    /// Make room for request slot `slot`.
    #[inline]
    pub fn ensure_slot(&mut self, slot: usize) {
        if self.reqs.len() <= slot {
            self.reqs.resize_with(slot + 1, ReqState::default);
        }
    }

    /// The state of request `slot` (a vacant one if never seen).
    #[inline]
    pub fn req(&self, slot: usize) -> Option<&ReqState> {
        self.reqs.get(slot)
    }

    /// `get_num_blocks_to_allocate`.
    #[allow(clippy::too_many_arguments)] // vLLM's signature
    pub fn get_num_blocks_to_allocate(
        &mut self,
        pool: &BlockPool,
        slot: usize,
        num_tokens: usize,
        new_computed: &[u32],
        total_computed: usize,
        num_local_computed: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
        prefill_end: usize,
    ) -> Result<i64> {
        self.ensure_slot(slot);
        let TypeManager { cfg, st, reqs } = self;
        let r = &mut reqs[slot];
        match cfg.spec.kind {
            Kind::CircularBuffer => Ok((!r.has_blocks()) as i64),
            Kind::Mamba { .. } => crate::manager::mamba::get_num_blocks_to_allocate(
                cfg,
                st,
                pool,
                r,
                num_tokens,
                new_computed,
                total_computed,
                num_local_computed,
                num_tokens_main_model,
                apply_admission_cap,
                prefill_end,
            ),
            _ => cfg
                .base_num_blocks_to_allocate(
                    pool,
                    r,
                    num_tokens,
                    new_computed,
                    total_computed,
                    num_local_computed,
                    apply_admission_cap,
                )
                .map(|n| n as i64),
        }
    }

    /// `add_local_computed_blocks`.
    pub fn add_local_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        new_computed: &[u32],
        num_local_computed: usize,
        num_external_computed: usize,
    ) -> Result<()> {
        self.ensure_slot(slot);
        let r = &mut self.reqs[slot];
        match self.cfg.spec.kind {
            Kind::CircularBuffer => Ok(()),
            Kind::CrossAttention => {
                if new_computed.is_empty() {
                    Ok(())
                } else {
                    Err(Error::Assertion("cross-attention blocks are never prefix-cache hits".into()))
                }
            }
            _ => self.cfg.base_add_local_computed_blocks(
                pool,
                r,
                new_computed,
                num_local_computed,
                num_external_computed,
            ),
        }
    }

    /// Blocks [`TypeManager::allocate_external_computed_blocks`] would take.
    pub fn external_blocks_needed(&self, slot: usize, num_local_computed: usize, num_external: usize) -> usize {
        let empty = ReqState::default();
        let r = self.reqs.get(slot).unwrap_or(&empty);
        match self.cfg.spec.kind {
            Kind::CrossAttention => 0,
            Kind::CircularBuffer => (!r.has_blocks()) as usize,
            _ => self.cfg.external_blocks_needed(r, num_local_computed, num_external),
        }
    }

    /// `allocate_external_computed_blocks`.
    pub fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        num_local_computed: usize,
        num_external: usize,
        record_for_zeroing: bool,
    ) -> Result<()> {
        self.ensure_slot(slot);
        let TypeManager { cfg, st, reqs } = self;
        let r = &mut reqs[slot];
        match cfg.spec.kind {
            Kind::CrossAttention => Ok(()),
            Kind::CircularBuffer => {
                crate::manager::full_attention::claim_ring_block(cfg, pool, st, r, record_for_zeroing).map(|_| ())
            }
            _ => cfg.base_allocate_external_computed_blocks(
                pool,
                st,
                r,
                num_local_computed,
                num_external,
                record_for_zeroing,
            ),
        }
    }

    /// Blocks [`TypeManager::allocate_new_blocks`] would take (an upper bound for Mamba).
    pub fn new_blocks_needed(&self, slot: usize, num_tokens: usize, num_tokens_main_model: usize) -> usize {
        let empty = ReqState::default();
        let r = self.reqs.get(slot).unwrap_or(&empty);
        match self.cfg.spec.kind {
            Kind::CircularBuffer => (!r.has_blocks()) as usize,
            Kind::Mamba { .. } => {
                crate::manager::mamba::new_blocks_needed(&self.cfg, r, num_tokens, num_tokens_main_model)
            }
            _ => self.cfg.new_blocks_needed(r, num_tokens),
        }
    }

    /// `allocate_new_blocks`: the blocks newly allocated for the request.
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
    ) -> Result<Vec<u32>> {
        self.ensure_slot(slot);
        let TypeManager { cfg, st, reqs } = self;
        let r = &mut reqs[slot];
        match cfg.spec.kind {
            Kind::CircularBuffer => crate::manager::full_attention::claim_ring_block(cfg, pool, st, r, true),
            Kind::Mamba { .. } => crate::manager::mamba::allocate_new_blocks(
                cfg,
                st,
                pool,
                r,
                request_id,
                num_tokens,
                num_tokens_main_model,
            ),
            _ => cfg.base_allocate_new_blocks(pool, st, r, num_tokens),
        }
    }

    /// `cache_blocks`.
    #[allow(clippy::too_many_arguments)] // vLLM's signature
    pub fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        req: &ReqInfo<'_>,
        hashes: &dyn HashSource,
        num_tokens: usize,
        retention_interval: Option<usize>,
        replay_boundaries: &[usize],
    ) -> Result<()> {
        self.ensure_slot(slot);
        let TypeManager { cfg, st, reqs } = self;
        let r = &mut reqs[slot];
        match cfg.spec.kind {
            Kind::CrossAttention => Err(Error::Value("Should not be called as prefix caching is disabled.".into())),
            k if k.caches_nothing() => Ok(()),
            // the source group's `publish_blocks` (its `cache_blocks` goes through the residency)
            Kind::FullAttention | Kind::Rswa { .. } | Kind::HiSparseSource => {
                cfg.base_cache_blocks(pool, r, req, hashes, num_tokens, retention_interval, replay_boundaries)?;
                if cfg.block_size != pool.hash_block_size() {
                    crate::manager::full_attention::cache_partial_tail_block(cfg, pool, r, req, hashes, num_tokens)?;
                }
                Ok(())
            }
            Kind::Mamba { .. } => crate::manager::mamba::cache_blocks(
                cfg,
                st,
                pool,
                r,
                req,
                hashes,
                num_tokens,
                retention_interval,
                replay_boundaries,
            ),
            _ => cfg.base_cache_blocks(pool, r, req, hashes, num_tokens, retention_interval, replay_boundaries),
        }
    }

    /// `find_longest_cache_hit` (a classmethod in vLLM: the group's spec is this manager's).
    pub fn find_longest_cache_hit(&self, pool: &BlockPool, q: &HitQuery<'_>) -> Result<Hit> {
        let cfg = &self.cfg;
        if q.verify.is_some()
            && matches!(cfg.spec.kind, Kind::SlidingWindow { .. } | Kind::ChunkedLocal { .. } | Kind::Mamba { .. })
        {
            // the manager refuses verify_hits for such groups: their hits do not run from block 0
            return Err(Error::Value("verify_hits: only full-attention groups' hits are verified".into()));
        }
        match cfg.spec.kind {
            Kind::FullAttention | Kind::Rswa { .. } | Kind::HiSparseSource => {
                crate::manager::full_attention::find_longest_cache_hit(cfg, pool, q)
            }
            Kind::SlidingWindow { window, .. } => {
                crate::manager::sliding_window::find_longest_cache_hit(cfg, window, pool, q)
            }
            Kind::ChunkedLocal { chunk } => crate::manager::chunked_local::find_longest_cache_hit(cfg, chunk, pool, q),
            Kind::Mamba { .. } => crate::manager::mamba::find_longest_cache_hit(cfg, pool, q),
            Kind::CircularBuffer | Kind::HiSparseResident | Kind::HiSparseHot { .. } => {
                Ok((vec![Vec::new(); q.group_ids.len()], 0))
            }
            Kind::CrossAttention => Err(Error::NotImplemented("CrossAttentionManager does not support caching".into())),
        }
    }

    /// `remove_skipped_blocks`.
    pub fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        self.ensure_slot(slot);
        let r = &mut self.reqs[slot];
        let cfg = &self.cfg;
        match cfg.spec.kind {
            Kind::CircularBuffer => Ok(()),
            Kind::Rswa { window } => crate::manager::full_attention::rswa_remove_skipped_blocks(
                cfg,
                window,
                pool,
                r,
                processed_computed_tokens,
                num_prompt_tokens,
            ),
            Kind::Mamba { .. } => crate::manager::mamba::remove_skipped_blocks(cfg, pool, r, processed_computed_tokens),
            _ => cfg.base_remove_skipped_blocks(pool, r, processed_computed_tokens),
        }
    }

    /// `pop_blocks_for_free`: the request's blocks (leading nulls trimmed); it is forgotten.
    pub fn pop_blocks_for_free(&mut self, slot: usize, request_id: &str) -> Vec<u32> {
        self.ensure_slot(slot);
        let r = &mut self.reqs[slot];
        if self.cfg.is_mamba_align() {
            r.allocated = false;
            r.last_state_block_idx = None;
            r.num_retired = None;
            r.checkpoint = None;
            r.producer_tail = None;
            self.st.pending_offloads.retain(|e| e.0 != request_id);
        }
        self.cfg.base_pop_blocks_for_free(r)
    }

    /// `free`: release the request's blocks tail first.
    pub fn free(&mut self, pool: &mut BlockPool, slot: usize, request_id: &str) -> Result<()> {
        let mut blocks = self.pop_blocks_for_free(slot, request_id);
        blocks.reverse();
        pool.free_blocks(&blocks, true)
    }

    /// `new_step_starts`.
    pub fn new_step_starts(&mut self) {
        self.st.cached_this_step.clear();
    }

    /// `take_new_block_ids`.
    pub fn take_new_block_ids(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.st.new_block_ids)
    }

    /// `take_pending_cow_copies`.
    pub fn take_pending_cow_copies(&mut self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.st.pending_cow)
    }

    /// `take_pending_boundary_state_offloads`.
    pub fn take_pending_offloads(&mut self) -> Vec<(String, u32, u32, usize)> {
        std::mem::take(&mut self.st.pending_offloads)
    }

    /// `finalize_partial_tail_offload`: (group, block, boundary tokens) of a producer's tail
    /// when the request finishes exactly at it.
    pub fn finalize_partial_tail_offload(
        &mut self,
        slot: usize,
        num_computed_tokens: usize,
        num_in_flight_tokens: usize,
    ) -> Option<(u32, u32, usize)> {
        if !self.cfg.is_mamba_align() {
            return None;
        }
        let r = self.reqs.get_mut(slot)?;
        let (block, boundary) = r.producer_tail.take()?;
        if num_in_flight_tokens != 0 || num_computed_tokens != boundary {
            return None;
        }
        Some((self.cfg.group_id, block, boundary))
    }

    /// True if nothing of request `slot` is held in this group.
    pub fn is_vacant(&self, slot: usize) -> bool {
        self.reqs.get(slot).is_none_or(|r| r.is_vacant())
    }
}
