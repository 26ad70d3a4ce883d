//! vLLM's `KVCacheCoordinator`: the group managers over one block pool (spec §6). Three
//! kinds, as `get_kv_cache_coordinator` picks them: no prefix cache (caching off, any number
//! of groups), unitary (one group) and hybrid (several groups: the iterative longest-hit
//! search every group must agree on, per-group block sizes, fine-grained partial hits).
//!
//! Requests are resolved to a slot once per call; every group keeps its state of the request
//! in that slot.

use crate::error::{Error, Result};
use crate::hashing::source::HashSource;
use crate::manager::group_state::{cdiv, HitQuery, ReqInfo, ReqState, TypeConfig, TypeManager};
use crate::manager::hisparse_tier::HiSparseTier;
use crate::manager::hit_verify::VerifyCtx;
use crate::manager::requests::RequestTable;
use crate::manager::spec::{Kind, MambaMode, ManagerConfig};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};

/// Which coordinator vLLM would build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoordinatorKind {
    /// `KVCacheCoordinatorNoPrefixCache`.
    NoPrefixCache,
    /// `UnitaryKVCacheCoordinator`.
    Unitary,
    /// `HybridKVCacheCoordinator`.
    Hybrid,
}

/// `SpecGroup`: groups with one spec, looked up together.
#[derive(Clone, Debug)]
pub struct SpecGroup {
    pub group_ids: Vec<u32>,
    pub use_eagle: bool,
    pub is_full: bool,
    pub is_mamba: bool,
}

/// The coordinator.
#[derive(Clone, Debug)]
pub struct Coordinator {
    pub kind: CoordinatorKind,
    pub managers: Vec<TypeManager>,
    pub scheduler_block_size: usize,
    pub hash_block_size: usize,
    pub num_reprefillable_tokens: usize,
    /// `eagle_group_ids` (as flags).
    pub eagle_groups: Vec<bool>,
    /// `drop_eagle_group_ids` (as flags).
    pub drop_eagle_groups: Vec<bool>,
    pub retention_interval: Option<usize>,
    pub enable_partial_hash_hits: bool,
    pub attention_groups: Vec<SpecGroup>,
    pub full_attention_group_id: Option<usize>,
    /// Lookups past a request's hashes raise as vLLM's ([`Caller::Vllm`](super::spec::Caller)).
    pub past_hashes_is_error: bool,
    /// HiSparse's host pool and residency, when a group is HiSparse's
    /// ([`super::coordinator_hisparse`] dispatches those groups' calls).
    pub hisparse: Option<Box<HiSparseTier>>,
    pub(crate) reqs: RequestTable<()>,
}

/// A few token positions kept inline (no heap allocation on the per-step caching path): the
/// replay boundaries (at most two) and a shared-prefix boundary with its EAGLE companion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Boundaries {
    v: [usize; 4],
    n: usize,
}

impl Boundaries {
    /// The positions in `s` (at most four).
    pub fn from_slice(s: &[usize]) -> Self {
        let mut b = Boundaries::default();
        for &x in s {
            b.push(x);
        }
        b
    }

    /// Add a position (every caller adds at most four in all).
    pub fn push(&mut self, x: usize) {
        debug_assert!(self.n < self.v.len(), "more than four boundaries");
        if let Some(slot) = self.v.get_mut(self.n) {
            *slot = x;
            self.n += 1;
        }
    }
}

impl std::ops::Deref for Boundaries {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        &self.v[..self.n]
    }
}

/// `replay_boundaries`: the positions a later request replaying the prompt resumes at
/// (ascending, without repeats).
pub fn replay_boundaries(num_prompt_tokens: usize, scheduler_block_size: usize, use_eagle: bool) -> Boundaries {
    if !use_eagle {
        return Boundaries::from_slice(&[num_prompt_tokens.saturating_sub(1)]);
    }
    let b = scheduler_block_size;
    let resend = (num_prompt_tokens.saturating_sub(1) / b * b).saturating_sub(b);
    let extension = (num_prompt_tokens / b * b).saturating_sub(b);
    let (lo, hi) = (resend.min(extension), resend.max(extension));
    if lo == hi {
        Boundaries::from_slice(&[lo])
    } else {
        Boundaries::from_slice(&[lo, hi])
    }
}

/// `eagle_proof_margin`: tokens an EAGLE group matches past a hit before dropping them.
pub fn eagle_proof_margin(block_size: usize, hash_block_size: usize, fine_grained_lookup: bool) -> usize {
    if fine_grained_lookup && block_size > hash_block_size {
        hash_block_size
    } else {
        block_size
    }
}

/// A hit: blocks per group, the agreed hit length, and the uncached common prefix.
pub type CoordinatedHit = (Vec<Vec<u32>>, usize, usize);

impl Coordinator {
    /// Build the coordinator vLLM's `get_kv_cache_coordinator` would for `cfg` (which must
    /// have been validated).
    pub fn new(cfg: &ManagerConfig) -> Result<Self> {
        cfg.validate()?;
        // vLLM's HiSparse configuration errors, before anything is built
        let hisparse = HiSparseTier::from_config(cfg)?.map(Box::new);
        let n = cfg.groups.len();
        let kind = if !cfg.enable_caching {
            CoordinatorKind::NoPrefixCache
        } else if n == 1 {
            CoordinatorKind::Unitary
        } else {
            CoordinatorKind::Hybrid
        };
        let mut eagle_groups: Vec<bool> = cfg.groups.iter().map(|g| g.is_eagle_group).collect();
        if cfg.use_eagle && !eagle_groups.iter().any(|&e| e) {
            eagle_groups = vec![true; n];
        }
        // 0.33's `drop_eagle_group_ids` (empty without use_eagle); 0.32 drops in every flagged group
        let drop_eagle_groups =
            if cfg.use_eagle || cfg.rules.eagle_groups_drop_always { eagle_groups.clone() } else { vec![false; n] };
        let mut managers: Vec<TypeManager> = cfg
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                TypeManager::new(TypeConfig::new(
                    g.clone(),
                    i as u32,
                    cfg.enable_caching,
                    cfg.scheduler_block_size,
                    cfg.dcp_world_size,
                    cfg.pcp_world_size,
                    cfg.needs_kv_cache_zeroing,
                    cfg.max_in_flight_tokens,
                    cfg.max_model_len,
                    cfg.rules,
                ))
            })
            .collect();
        for m in &mut managers {
            // `HiSparseSourceManager.records_new_block_ids` is False (host blocks are never zeroed)
            if m.cfg.spec.kind == Kind::HiSparseSource {
                m.cfg.record_new_block_ids = false;
            }
        }
        if cfg.use_eagle {
            for m in &mut managers {
                if m.cfg.spec.kind.is_mamba() {
                    m.cfg.drop_eagle_checkpoint_block = true;
                }
            }
        }
        let mut c = Coordinator {
            kind,
            managers,
            scheduler_block_size: cfg.scheduler_block_size,
            hash_block_size: cfg.hash_block_size,
            num_reprefillable_tokens: cfg.num_prefill_lookahead.saturating_sub(1),
            eagle_groups,
            drop_eagle_groups,
            retention_interval: cfg.retention_interval,
            enable_partial_hash_hits: false,
            attention_groups: Vec::new(),
            full_attention_group_id: None,
            past_hashes_is_error: !cfg.caller.is_kvblock(),
            hisparse,
            reqs: RequestTable::default(),
        };
        match kind {
            CoordinatorKind::NoPrefixCache => {}
            CoordinatorKind::Unitary => {
                c.managers[0].cfg.use_eagle = c.drop_eagle_groups[0];
            }
            CoordinatorKind::Hybrid => c.init_hybrid(cfg)?,
        }
        if cfg.enable_mamba_shared_prefix_checkpoint
            && c.eagle_groups.iter().any(|&e| e)
            && c.enable_partial_hash_hits
            && c.num_reprefillable_tokens == 0
        {
            for m in &mut c.managers {
                if m.cfg.spec.kind.is_mamba() {
                    m.cfg.shared_prefix_checkpoint = true;
                }
            }
        }
        Ok(c)
    }

    /// Whether the manager's `mamba_shared_prefix_checkpoint` is on.
    pub fn mamba_shared_prefix_checkpoint(&self) -> bool {
        self.managers.iter().any(|m| m.cfg.shared_prefix_checkpoint)
    }

    fn init_hybrid(&mut self, cfg: &ManagerConfig) -> Result<()> {
        let h = self.hash_block_size;
        for (i, g) in cfg.groups.iter().enumerate() {
            let replicated = !g.dcp_sharded;
            if cfg.pcp_world_size > 1 && !(g.kind.is_full_attention() || replicated) {
                return Err(cfg.asserted(
                    &format!("kv_cache_groups[{i}]"),
                    "PCP only supports full attention and replicated draft groups",
                ));
            }
            if cfg.dcp_world_size > 1 && !(g.kind.is_full_attention() || replicated) {
                return Err(cfg.asserted(
                    &format!("kv_cache_groups[{i}]"),
                    "DCP with hybrid KV cache layouts only supports full-attention, Mamba, and replicated draft groups",
                ));
            }
        }
        // fine-grained hits: Mamba "align" with a block larger than the hash block, and every
        // other prefix-cacheable group able to look up at hash granularity
        let dcp = cfg.dcp_world_size;
        let mamba_fine = cfg.groups.iter().any(|g| {
            matches!(g.kind, Kind::Mamba { mode: MambaMode::Align, .. })
                && ((dcp == 1 && g.block_size > h) || (dcp > 1 && g.block_size >= h))
        });
        let all_fine = cfg.groups.iter().all(|g| {
            !g.prefix_cacheable || g.kind.supports_fine_grained_hash_lookup() || g.block_size * cfg.dcp_of(g) == h
        });
        self.enable_partial_hash_hits = mamba_fine && all_fine;
        let align = self.cache_hit_alignment_tokens();
        for m in &mut self.managers {
            m.cfg.cache_hit_alignment_tokens = align;
        }
        // spec groups: equal specs (and manager class) are looked up together
        let mut groups: Vec<(u32, SpecGroup)> = Vec::new();
        for (i, g) in cfg.groups.iter().enumerate() {
            if !g.prefix_cacheable {
                continue;
            }
            let use_eagle = self.drop_eagle_groups[i];
            match groups.iter_mut().find(|(class, _)| *class == g.spec_class) {
                Some((_, sg)) => {
                    sg.group_ids.push(i as u32);
                    sg.use_eagle |= use_eagle;
                }
                None => groups.push((
                    g.spec_class,
                    SpecGroup {
                        group_ids: vec![i as u32],
                        use_eagle,
                        is_full: g.kind.is_full_attention(),
                        is_mamba: g.kind.is_mamba(),
                    },
                )),
            }
        }
        let mut groups: Vec<SpecGroup> = groups.into_iter().map(|(_, g)| g).collect();
        if groups.is_empty() {
            return Err(Error::value(
                "kv_cache_groups",
                "HybridKVCacheCoordinator requires at least one cacheable group",
            ));
        }
        groups.sort_by_key(|g| !g.is_full); // stable: full attention first
        self.full_attention_group_id = groups[0].is_full.then(|| groups[0].group_ids[0] as usize);
        for g in &groups {
            if g.use_eagle {
                for &gid in &g.group_ids {
                    self.managers[gid as usize].cfg.use_eagle = true;
                }
            }
        }
        self.attention_groups = groups;
        Ok(())
    }

    /// `_cache_hit_alignment_tokens`.
    pub fn cache_hit_alignment_tokens(&self) -> usize {
        if self.enable_partial_hash_hits {
            self.hash_block_size
        } else {
            self.scheduler_block_size
        }
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.managers.len()
    }

    /// The slot of a known request.
    #[inline]
    pub fn slot(&self, request_id: &str) -> Option<usize> {
        self.reqs.slot(request_id).map(|s| s as usize)
    }

    /// The slot of a known request and the generation of its entry (see
    /// [`Coordinator::slot_generation`]).
    #[inline]
    pub fn slot_and_generation(&self, request_id: &str) -> Option<(usize, u64)> {
        self.reqs.slot_gen(request_id).map(|(s, g)| (s as usize, g))
    }

    /// The generation of the request entry in `slot`: a number no other request entry ever
    /// had (0 for a vacant slot). A `(slot, generation)` pair kept by a caller names the same
    /// request for as long as the generation matches.
    #[inline]
    pub fn slot_generation(&self, slot: usize) -> u64 {
        self.reqs.gen_at(slot as u32)
    }

    /// Start loading what a no-op `allocate_slots` or `cache_blocks` reads of the request in
    /// `slot` (its generation and each group's entry), so that those misses overlap: for a
    /// caller that has just learnt the slot (see [`crate::prefetch`]).
    #[inline(always)]
    pub fn prefetch_request(&self, slot: usize) {
        self.reqs.prefetch_gen(slot as u32);
        for m in &self.managers {
            if let Some(r) = m.req(slot) {
                crate::prefetch::prefetch_bytes(r as *const ReqState as *const u8, ReqState::HOT_BYTES);
            }
        }
    }

    /// The slot of a request, added if new.
    #[inline]
    pub fn slot_or_insert(&mut self, request_id: &str) -> usize {
        match self.reqs.slot(request_id) {
            Some(s) => s as usize,
            None => {
                let s = self.reqs.insert(request_id, ()) as usize;
                for m in &mut self.managers {
                    m.ensure_slot(s);
                    m.reqs[s] = Default::default();
                }
                s
            }
        }
    }

    /// Forget the slot of a request no group holds anything of.
    pub fn release_if_vacant(&mut self, request_id: &str) {
        if let Some(s) = self.slot(request_id) {
            self.release_slot_if_vacant(s, request_id);
        }
    }

    /// Run `f` on `request_id`'s slot (made for it if it has none), then forget the slot if
    /// no group keeps anything for the request ([`Coordinator::release_if_vacant`]): a
    /// per-group call leaves no entry behind that vLLM's `defaultdict`s would not hold.
    pub fn in_request_slot<R>(&mut self, request_id: &str, f: impl FnOnce(&mut Self, usize) -> R) -> R {
        let slot = self.slot_or_insert(request_id);
        let out = f(self, slot);
        self.release_if_vacant(request_id);
        out
    }

    /// [`Coordinator::release_if_vacant`] for the request in `slot` (`request_id`'s slot):
    /// the id is looked up only to forget it.
    pub fn release_slot_if_vacant(&mut self, slot: usize, request_id: &str) {
        debug_assert_eq!(self.slot(request_id), Some(slot));
        if self.managers.iter().all(|m| m.is_vacant(slot)) {
            self.reqs.remove(request_id);
            if let Some(t) = self.hisparse.as_deref_mut() {
                t.collect_publication(request_id);
            }
        }
    }

    /// Forget the slot of a request no group holds a block for, even if a group made it a
    /// (then empty) table: a failed first allocation in strict mode leaves nothing behind.
    pub fn forget_if_blockless(&mut self, request_id: &str) {
        if let Some(s) = self.slot(request_id) {
            if self.managers.iter().all(|m| m.req(s).is_none_or(|r| r.blocks.is_empty())) {
                for m in &mut self.managers {
                    m.ensure_slot(s);
                    m.reqs[s] = Default::default();
                }
                self.reqs.remove(request_id);
            }
        }
    }

    /// Request ids with a slot (any order).
    pub fn request_ids(&self) -> Vec<String> {
        self.reqs.ids()
    }

    /// `get_num_blocks_to_allocate` summed over the groups (may be negative, as vLLM's).
    #[allow(clippy::too_many_arguments)] // vLLM's signature
    pub fn get_num_blocks_to_allocate(
        &mut self,
        pool: &BlockPool,
        slot: usize,
        request_id: &str,
        num_tokens: usize,
        new_computed: &[&[u32]],
        num_encoder_tokens: usize,
        total_computed: usize,
        num_local_computed: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
        prefill_end: usize,
    ) -> Result<i64> {
        let prefill_end = if self.retention_interval != Some(0) { 0 } else { prefill_end };
        let mut total = 0i64;
        for i in 0..self.managers.len() {
            if self.managers[i].cfg.spec.kind.is_hisparse() {
                total += self.hisparse_num_blocks(
                    pool,
                    i,
                    slot,
                    request_id,
                    num_tokens,
                    new_computed.get(i).copied().unwrap_or(&[]),
                    total_computed,
                    num_local_computed,
                    apply_admission_cap,
                )? as i64;
                continue;
            }
            let m = &mut self.managers[i];
            total += if m.cfg.spec.kind == Kind::CrossAttention {
                m.get_num_blocks_to_allocate(
                    pool,
                    slot,
                    num_encoder_tokens,
                    &[],
                    0,
                    0,
                    num_encoder_tokens,
                    apply_admission_cap,
                    0,
                )?
            } else {
                m.get_num_blocks_to_allocate(
                    pool,
                    slot,
                    num_tokens,
                    new_computed.get(i).copied().unwrap_or(&[]),
                    total_computed,
                    num_local_computed,
                    num_tokens_main_model,
                    apply_admission_cap,
                    prefill_end,
                )?
            };
        }
        Ok(total)
    }

    /// Each group's prefill checkpoint for the request in `slot` (Mamba "align" groups set it
    /// while counting blocks), to put back with [`Coordinator::restore_checkpoints`].
    pub fn checkpoints(&self, slot: usize) -> Vec<Option<(usize, usize)>> {
        self.managers.iter().map(|m| m.req(slot).and_then(|r| r.checkpoint)).collect()
    }

    /// Put back the checkpoints [`Coordinator::checkpoints`] read.
    pub fn restore_checkpoints(&mut self, slot: usize, saved: &[Option<(usize, usize)>]) {
        for (m, &c) in self.managers.iter_mut().zip(saved) {
            if let Some(r) = m.reqs.get_mut(slot) {
                r.checkpoint = c;
            }
        }
    }

    /// True if some group tracks the request as running (`num_cached_block`).
    pub fn is_running(&self, slot: usize) -> bool {
        self.managers.iter().any(|m| m.req(slot).is_some_and(|r| r.num_cached.is_some()))
    }

    /// Blocks `allocate_new_computed_blocks` (when `adopts`) and `allocate_new_blocks` would
    /// take from the free queue, the free hit blocks they touch included: checked before
    /// anything changes, so that an allocation cannot run out half way.
    #[allow(clippy::too_many_arguments)] // the allocation's arguments
    pub fn blocks_taken(
        &self,
        pool: &BlockPool,
        slot: usize,
        request_id: &str,
        adopts: bool,
        new_computed: &[&[u32]],
        num_local_computed: usize,
        num_external: usize,
        num_tokens: usize,
        num_tokens_main_model: usize,
        num_encoder_tokens: usize,
    ) -> usize {
        let phase_a = adopts && !self.is_running(slot);
        let empty = ReqState::default();
        let mut need = 0;
        let mut touched: Vec<u32> = Vec::new();
        for (i, m) in self.managers.iter().enumerate() {
            let current = m.req(slot).unwrap_or(&empty);
            if m.cfg.spec.kind.is_hisparse() {
                let n_tokens = num_tokens;
                need += self.hisparse_blocks_taken(
                    i,
                    current,
                    request_id,
                    phase_a,
                    num_local_computed,
                    num_external,
                    n_tokens,
                );
                continue;
            }
            let sim_owned;
            let sim: &ReqState = if phase_a {
                let mut sim = current.clone();
                let nc = new_computed.get(i).copied().unwrap_or(&[]);
                match m.cfg.spec.kind {
                    Kind::CircularBuffer | Kind::CrossAttention => {}
                    _ => {
                        let skipped = m.cfg.num_skipped_tokens(num_local_computed + num_external) / m.cfg.block_size;
                        let kept = &nc[skipped.min(nc.len())..];
                        if m.cfg.enable_caching {
                            touched.extend(kept.iter().copied().filter(|&b| b != NULL_BLOCK && pool.ref_of(b) == 0));
                        }
                        sim.present = true;
                        sim.blocks = vec![NULL_BLOCK; skipped + kept.len()];
                        if m.cfg.has_partial_local_hit(kept, num_local_computed) {
                            sim.partial_hit = Some((0, NULL_BLOCK));
                        }
                    }
                }
                if num_external > 0 {
                    let ext = match m.cfg.spec.kind {
                        Kind::CrossAttention => 0,
                        Kind::CircularBuffer => (!sim.has_blocks()) as usize,
                        _ => m.cfg.external_blocks_needed(&sim, num_local_computed, num_external),
                    };
                    need += ext;
                    sim.present = true;
                    sim.blocks.extend(std::iter::repeat_n(NULL_BLOCK, ext));
                }
                sim_owned = sim;
                &sim_owned
            } else {
                current
            };
            let n_tokens = if m.cfg.spec.kind == Kind::CrossAttention { num_encoder_tokens } else { num_tokens };
            need += match m.cfg.spec.kind {
                Kind::Mamba { .. } => {
                    crate::manager::mamba::new_blocks_needed(&m.cfg, sim, n_tokens, num_tokens_main_model)
                }
                Kind::CircularBuffer => (!sim.has_blocks()) as usize,
                _ => m.cfg.new_blocks_needed(sim, n_tokens),
            };
        }
        touched.sort_unstable();
        touched.dedup();
        need + touched.len()
    }

    /// Check that adopting `new_computed` can go through: vLLM asserts, half way through, that
    /// a partial hit's tail block (the last hit block, when `num_local_computed` ends inside
    /// a block) sits where the copy-on-write redirect looks for it, at index
    /// `num_local_computed / block_size` of the table it builds.
    pub fn check_adoption(
        &self,
        slot: Option<usize>,
        new_computed: &[&[u32]],
        num_local_computed: usize,
        num_external: usize,
    ) -> Result<()> {
        if slot.is_some_and(|s| self.is_running(s)) {
            return Ok(());
        }
        for (i, m) in self.managers.iter().enumerate() {
            if matches!(m.cfg.spec.kind, Kind::CircularBuffer | Kind::CrossAttention | Kind::HiSparseResident)
                || matches!(m.cfg.spec.kind, Kind::HiSparseHot { .. })
            {
                continue;
            }
            let nc = new_computed.get(i).copied().unwrap_or(&[]);
            let skipped = m.cfg.num_skipped_tokens(num_local_computed + num_external) / m.cfg.block_size;
            let kept = &nc[skipped.min(nc.len())..];
            if m.cfg.has_partial_local_hit(kept, num_local_computed) {
                let block_idx = num_local_computed / m.cfg.block_size;
                if block_idx + 1 != skipped + kept.len() {
                    return Err(Error::Assertion(format!(
                        "kv_cache_groups[{i}]: a hit ending at token {num_local_computed} puts its tail block at \
                         index {block_idx}, but the table would hold {} blocks",
                        skipped + kept.len()
                    )));
                }
            }
        }
        Ok(())
    }

    /// `allocate_new_computed_blocks`: adopt the hit blocks (touching every group's first),
    /// then allocate blocks for external tokens.
    #[allow(clippy::too_many_arguments)] // vLLM's signature, plus the slot
    pub fn allocate_new_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        request_id: &str,
        new_computed: &[&[u32]],
        num_local_computed: usize,
        num_external: usize,
        skip_zeroing_group_ids: &[u32],
    ) -> Result<()> {
        if self.is_running(slot) {
            if new_computed.iter().any(|b| !b.is_empty()) {
                return Err(Error::Assertion("a running request cannot adopt new computed blocks".into()));
            }
            return Ok(());
        }
        for i in 0..self.managers.len() {
            let nc = new_computed.get(i).copied().unwrap_or(&[]);
            if self.managers[i].cfg.spec.kind.is_hisparse() {
                self.hisparse_add_local(pool, i, slot, request_id, nc, num_local_computed, num_external)?;
                continue;
            }
            self.managers[i].add_local_computed_blocks(pool, slot, nc, num_local_computed, num_external)?;
        }
        if num_external > 0 {
            for i in 0..self.managers.len() {
                let record = !skip_zeroing_group_ids.contains(&(i as u32));
                if self.managers[i].cfg.spec.kind.is_hisparse() {
                    self.hisparse_external(pool, i, slot, request_id, num_local_computed, num_external, record)?;
                    continue;
                }
                self.managers[i].allocate_external_computed_blocks(
                    pool,
                    slot,
                    num_local_computed,
                    num_external,
                    record,
                )?;
                self.drain_reuse_watchers(pool)?;
            }
        }
        Ok(())
    }

    /// `allocate_new_blocks`: per group, the new blocks.
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        num_encoder_tokens: usize,
    ) -> Result<Vec<Vec<u32>>> {
        let mut out = Vec::with_capacity(self.managers.len());
        for i in 0..self.managers.len() {
            if self.managers[i].cfg.spec.kind.is_hisparse() {
                out.push(self.hisparse_allocate_new(pool, i, slot, request_id, num_tokens, num_tokens_main_model)?);
                continue;
            }
            let m = &mut self.managers[i];
            let n = if m.cfg.spec.kind == Kind::CrossAttention { num_encoder_tokens } else { num_tokens };
            out.push(m.allocate_new_blocks(pool, slot, request_id, n, num_tokens_main_model)?);
            self.drain_reuse_watchers(pool)?;
        }
        Ok(out)
    }

    /// `_align_cacheable`.
    fn align_cacheable(&self, n: usize) -> usize {
        if self.enable_partial_hash_hits {
            n
        } else {
            n / self.scheduler_block_size * self.scheduler_block_size
        }
    }

    /// `get_num_cacheable_tokens`: the prefix of `n` computed tokens group `gid` may cache.
    pub fn num_cacheable_tokens(&self, n: usize, gid: usize) -> usize {
        if self.kind != CoordinatorKind::Hybrid {
            return n.saturating_sub(self.num_reprefillable_tokens);
        }
        let cached = self.align_cacheable(n);
        let m = &self.managers[gid];
        if m.cfg.use_eagle && cached > 0 {
            let finalized = n.saturating_sub(self.num_reprefillable_tokens);
            return finalized.min(self.align_cacheable(finalized) + m.cfg.block_size);
        }
        cached
    }

    /// `cache_blocks(request, num_computed_tokens)`.
    pub fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        req: &ReqInfo<'_>,
        hashes: &dyn HashSource,
        num_computed_tokens: usize,
    ) -> Result<()> {
        let boundaries = replay_boundaries(
            req.num_prompt_tokens,
            self.scheduler_block_size,
            self.drop_eagle_groups.iter().any(|&d| d),
        );
        if pool.events_enabled() {
            self.check_cache_within_table(pool, slot, req, hashes, num_computed_tokens, &boundaries)?;
        }
        for gid in 0..self.managers.len() {
            if !self.managers[gid].cfg.enable_caching {
                continue;
            }
            let n = self.num_cacheable_tokens(num_computed_tokens, gid);
            let retention = self.retention_interval;
            if self.managers[gid].cfg.spec.kind == Kind::HiSparseSource {
                self.hisparse_cache(pool, req, hashes, n, retention, &boundaries)?;
                continue;
            }
            self.managers[gid].cache_blocks(pool, slot, req, hashes, n, retention, &boundaries)?;
        }
        Ok(())
    }

    /// With KV events on, vLLM's `cache_full_blocks` indexes the request's table for each
    /// newly full block when it builds the `BlockStored` event, and so raises `IndexError` for
    /// a count past the blocks the request holds (with events off it slices the table and
    /// raises nothing). Checked before anything changes: the `IndexError` leaves the cache
    /// as it was (vLLM has by then cached the held blocks, and emits no event). vLLM caches
    /// group by group and a cross-attention group with caching on raises `ValueError` as soon
    /// as it is reached, so the groups after one are never checked: the caching loop raises
    /// that `ValueError` where vLLM does, after the groups before it. A group whose caching
    /// passes a `block_mask` (a sliding window or Mamba group at an alignment) meets vLLM's
    /// assertion that the mask covers the sliced table first: `AssertionError`, as with
    /// events off.
    fn check_cache_within_table(
        &self,
        pool: &BlockPool,
        slot: usize,
        req: &ReqInfo<'_>,
        hashes: &dyn HashSource,
        num_computed_tokens: usize,
        replay_boundaries: &[usize],
    ) -> Result<()> {
        let hashed = hashes.len() * pool.hash_block_size();
        for (gid, m) in self.managers.iter().enumerate() {
            if !m.cfg.enable_caching {
                continue;
            }
            if m.cfg.spec.kind == Kind::CrossAttention {
                break;
            }
            // the HiSparse groups cache nothing now (the source group's publication waits for
            // durable host pages and caches what its table holds)
            if !m.cfg.spec.prefix_cacheable || m.cfg.spec.kind.is_hisparse() {
                continue;
            }
            let Some(r) = m.reqs.get(slot) else { continue };
            let n = self.num_cacheable_tokens(num_computed_tokens, gid);
            let num_full = n.min(hashed) / m.cfg.block_size;
            let num_cached = r.num_cached.unwrap_or(0);
            if num_full > num_cached && num_full > r.blocks.len() {
                let retention = self.retention_interval;
                if m.cfg.cache_mask(req, num_cached, num_full, retention, replay_boundaries).is_some() {
                    return Err(Error::Assertion(format!(
                        "block_mask has {} entries for the {} blocks held past {num_cached} (group {gid})",
                        num_full - num_cached,
                        r.blocks.len().saturating_sub(num_cached)
                    )));
                }
                let msg = format!(
                    "list index out of range: caching {num_full} full blocks of a request holding {} (group {gid})",
                    r.blocks.len()
                );
                // vLLM's callers get vLLM's IndexError; kvblock's own API a ValueError
                return Err(if self.past_hashes_is_error { Error::Index(msg) } else { Error::Value(msg) });
            }
        }
        Ok(())
    }

    /// The hash indices [`Coordinator::cache_blocks`] may read for `num_computed_tokens`
    /// (to check them before anything changes): `(lo, hi)`, hi exclusive.
    pub fn cache_read_range(
        &self,
        slot: usize,
        num_computed_tokens: usize,
        num_prompt_tokens: usize,
        num_hashes: usize,
    ) -> (usize, usize) {
        let h = self.hash_block_size;
        let hi = (num_computed_tokens / h).min(num_hashes);
        let mut lo = hi;
        for m in &self.managers {
            if m.cfg.spec.kind.caches_nothing() {
                continue; // its cache_blocks reads no hash
            }
            let scale = (m.cfg.block_size / h).max(1);
            let cached = m.req(slot).and_then(|r| r.num_cached).unwrap_or(0);
            lo = lo.min((cached * scale).saturating_sub(scale));
            if m.cfg.block_size != h {
                // a partial tail at the prompt's last hash boundaries, or a checkpoint
                lo = lo.min((num_prompt_tokens / h).saturating_sub(2));
                if let Some((pos, _)) = m.req(slot).and_then(|r| r.checkpoint) {
                    lo = lo.min((pos / h).saturating_sub(2));
                }
            }
        }
        (lo.min(hi), hi)
    }

    /// `find_longest_cache_hit(block_hashes, max_cache_hit_length)`; with `verify`, every
    /// block found is checked against the request's content (verify on hit).
    pub fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        hashes: &dyn HashSource,
        max_length: usize,
        verify: Option<VerifyCtx<'_>>,
    ) -> Result<CoordinatedHit> {
        let n = self.managers.len();
        match self.kind {
            CoordinatorKind::NoPrefixCache => Ok((vec![Vec::new(); n], 0, 0)),
            CoordinatorKind::Unitary => {
                let m = &self.managers[0];
                let q = HitQuery {
                    hashes,
                    max_length,
                    group_ids: &[0],
                    drop_eagle_block: self.drop_eagle_groups[0],
                    alignment_tokens: m.cfg.block_size,
                    past_hashes_is_error: self.past_hashes_is_error,
                    verify,
                };
                let (blocks, len) = m.find_longest_cache_hit(self.pool_of(0, pool), &q)?;
                Ok((blocks, len, 0))
            }
            CoordinatorKind::Hybrid => self.find_hybrid(pool, hashes, max_length, verify),
        }
    }

    fn find_hybrid(
        &self,
        pool: &BlockPool,
        hashes: &dyn HashSource,
        max_length: usize,
        verify: Option<VerifyCtx<'_>>,
    ) -> Result<CoordinatedHit> {
        let n = self.managers.len();
        let h = self.hash_block_size;
        let align = self.cache_hit_alignment_tokens();
        let mut hit_length = max_length;
        let mut longest = 0usize;
        let mut blocks_by_group: Vec<Option<Vec<u32>>> = vec![None; n];
        let mut len_by_group = vec![0usize; n];
        let simple = self.attention_groups.len() == 2 && self.attention_groups[0].is_full;
        let mut eagle_verified: Vec<bool> = vec![false; self.attention_groups.len()];
        loop {
            let mut curr = hit_length;
            for (idx, sg) in self.attention_groups.iter().enumerate() {
                let first = sg.group_ids[0] as usize;
                let m = &self.managers[first];
                if sg.is_full && blocks_by_group[first].is_some() {
                    // full attention is downward-closed: looked up once, then only trimmed
                    curr = curr.min(len_by_group[first]);
                    continue;
                }
                let drop = sg.use_eagle && !eagle_verified[idx];
                let mut max_len = curr;
                if drop && !sg.is_mamba {
                    let margin = eagle_proof_margin(
                        m.cfg.block_size,
                        h,
                        self.enable_partial_hash_hits && m.cfg.spec.kind.supports_fine_grained_hash_lookup(),
                    );
                    max_len = (curr + margin).min(hashes.len() * h);
                }
                let q = HitQuery {
                    hashes,
                    max_length: max_len,
                    group_ids: &sg.group_ids,
                    drop_eagle_block: drop,
                    alignment_tokens: align,
                    past_hashes_is_error: self.past_hashes_is_error,
                    verify,
                };
                let (hit_blocks, new_len) = m.find_longest_cache_hit(self.pool_of(first, pool), &q)?;
                if drop {
                    eagle_verified[idx] = true;
                } else if new_len < curr {
                    eagle_verified.iter_mut().for_each(|v| *v = false);
                }
                curr = new_len;
                for (&gid, b) in sg.group_ids.iter().zip(hit_blocks) {
                    blocks_by_group[gid as usize] = Some(b);
                    len_by_group[gid as usize] = new_len;
                }
                longest = longest.max(curr);
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        for sg in &self.attention_groups {
            if !sg.is_full {
                continue;
            }
            let lead = &self.managers[sg.group_ids[0] as usize];
            if lead.cfg.spec.kind == Kind::HiSparseSource {
                // `retains_longer_hit`: the host tier keeps prefixes the device groups lost
                continue;
            }
            let bs = lead.cfg.block_size;
            let nb = cdiv(hit_length, bs);
            for &gid in &sg.group_ids {
                if let Some(b) = &mut blocks_by_group[gid as usize] {
                    b.truncate(nb);
                    len_by_group[gid as usize] = hit_length;
                }
            }
        }
        let uncached = longest.saturating_sub(hit_length);
        Ok((blocks_by_group.into_iter().map(|b| b.unwrap_or_default()).collect(), hit_length, uncached))
    }

    /// `find_longest_cache_hit_per_group`: every spec group on its own.
    pub fn find_longest_cache_hit_per_group(
        &self,
        pool: &BlockPool,
        hashes: &dyn HashSource,
        max_length: usize,
    ) -> Result<(Vec<Vec<u32>>, Vec<usize>)> {
        let n = self.managers.len();
        let h = self.hash_block_size;
        let mut blocks = vec![Vec::new(); n];
        let mut lens = vec![0usize; n];
        for sg in &self.attention_groups {
            let m = &self.managers[sg.group_ids[0] as usize];
            let mut len = max_length;
            if sg.use_eagle && !sg.is_mamba {
                let margin = eagle_proof_margin(
                    m.cfg.block_size,
                    h,
                    self.enable_partial_hash_hits && m.cfg.spec.kind.supports_fine_grained_hash_lookup(),
                );
                len = (max_length + margin).min(hashes.len() * h);
            }
            let q = HitQuery {
                hashes,
                max_length: len,
                group_ids: &sg.group_ids,
                drop_eagle_block: sg.use_eagle,
                alignment_tokens: self.cache_hit_alignment_tokens(),
                past_hashes_is_error: self.past_hashes_is_error,
                verify: None,
            };
            let (hb, hit) = m.find_longest_cache_hit(self.pool_of(sg.group_ids[0] as usize, pool), &q)?;
            for (&gid, b) in sg.group_ids.iter().zip(hb) {
                blocks[gid as usize] = b;
                lens[gid as usize] = hit;
            }
        }
        Ok((blocks, lens))
    }

    /// `emit_cached_block_events(request, computed_blocks)`, each group on its pool: HiSparse's
    /// source group's hits are host blocks, whose events go into `pool`'s queue with medium
    /// CPU (vLLM's `SharedEventQueueBlockPool`).
    pub fn emit_cached_block_events(
        &mut self,
        pool: &mut BlockPool,
        hashes: &dyn HashSource,
        computed: &[Vec<u32>],
        tag: u64,
    ) -> Result<()> {
        for (gid, blocks) in computed.iter().enumerate() {
            if blocks.is_empty() {
                continue;
            }
            let bs = self.managers[gid].cfg.spec.block_size;
            let view = crate::hashing::source::ScaledHashes::new(hashes, pool.hash_block_size(), bs)?;
            match self.hisparse.as_deref_mut() {
                Some(t) if t.host_group() == gid => {
                    t.host.emit_cached_block_events(&view, blocks.len(), bs, gid as u32, tag)?;
                    t.move_events(pool);
                }
                _ => pool.emit_cached_block_events(&view, blocks.len(), bs, gid as u32, tag)?,
            }
        }
        Ok(())
    }

    /// `remove_skipped_blocks` in every group.
    pub fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        for m in &mut self.managers {
            if m.cfg.spec.kind.is_hisparse() {
                // full attention and HiSparse's own kinds skip no tokens
                continue;
            }
            m.remove_skipped_blocks(pool, slot, processed_computed_tokens, num_prompt_tokens)?;
        }
        Ok(())
    }

    /// `free(request_id)`: every group frees its table tail first, in group order (as
    /// [`Coordinator::free_request`] for a finished request).
    pub fn free(&mut self, pool: &mut BlockPool, request_id: &str) -> Result<()> {
        self.free_request(pool, request_id, true)
    }

    /// `free(request_id)` with `finished` = `request.is_finished()`, which HiSparse's
    /// coordinator reads: a finished request with spills still running keeps its host blocks
    /// until they complete and publish; a preempted one drops its pending publication.
    pub fn free_request(&mut self, pool: &mut BlockPool, request_id: &str, finished: bool) -> Result<()> {
        let Some(slot) = self.slot(request_id) else {
            return Ok(());
        };
        for i in 0..self.managers.len() {
            if self.managers[i].cfg.spec.kind.is_hisparse() {
                self.hisparse_free(pool, i, slot, request_id, finished)?;
                continue;
            }
            self.managers[i].free(pool, slot, request_id)?;
        }
        self.release_if_vacant(request_id);
        Ok(())
    }

    /// `pop_blocks_for_free(request_id)`: every group's blocks (allocation order), the
    /// request forgotten; the caller frees them (reversed) into the one pool. Errors: a
    /// manager with HiSparse groups (their blocks live in two pools and their coordinator
    /// frees with the device pool: `NotImplementedError`; see
    /// [`Coordinator::pop_blocks_for_free_routed`]), changing nothing.
    pub fn pop_blocks_for_free(&mut self, request_id: &str) -> Result<Vec<u32>> {
        if self.hisparse.is_some() {
            return Err(Error::NotImplemented(
                "pop_blocks_for_free of a manager with HiSparse groups (free the request instead)".into(),
            ));
        }
        let Some(slot) = self.slot(request_id) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for m in &mut self.managers {
            out.extend(m.pop_blocks_for_free(slot, request_id));
        }
        self.release_if_vacant(request_id);
        Ok(out)
    }

    /// `get_blocks(request_id)`: per group, the table (empty when unknown).
    pub fn get_blocks(&self, request_id: &str) -> Vec<&[u32]> {
        let slot = self.slot(request_id);
        self.managers
            .iter()
            .map(|m| match slot.and_then(|s| m.req(s)) {
                Some(r) if r.present => r.blocks.as_slice(),
                _ => &[],
            })
            .collect()
    }

    /// `new_step_starts`.
    pub fn new_step_starts(&mut self) {
        for m in &mut self.managers {
            m.new_step_starts();
        }
    }

    /// Most live requests [`Coordinator::warm_live_requests`] reads: past this their state no
    /// longer stays in cache until the step's calls, and the pass would only add its own cost.
    pub const WARM_MAX_LIVE: usize = 1024;

    /// Read, for every live request, what the no-op checks of its next `allocate_slots` and
    /// `cache_blocks` read (its generation, and per group whether it is present, its table's
    /// length, its cached count and partial hit), calling `each(slot)` for the caller's own
    /// per-request state, so that a step's calls find it in cache: one pass over small arrays
    /// whose misses overlap, instead of several misses per call. Nothing is read when more
    /// than [`Coordinator::WARM_MAX_LIVE`] requests are live.
    pub fn warm_live_requests(&self, mut each: impl FnMut(usize) -> u64) {
        if self.reqs.len() > Self::WARM_MAX_LIVE {
            return;
        }
        let mut sum = 0u64;
        for s in self.reqs.live_slots() {
            sum = sum.wrapping_add(self.reqs.gen_at(s as u32)).wrapping_add(each(s));
            for m in &self.managers {
                if let Some(r) = m.req(s) {
                    sum = sum
                        .wrapping_add(r.present as u64)
                        .wrapping_add(r.blocks.len() as u64)
                        .wrapping_add(r.num_cached.unwrap_or(0) as u64)
                        .wrapping_add(r.partial_hit.is_some() as u64);
                }
            }
        }
        std::hint::black_box(sum); // keeps the reads
    }

    /// Forget every request (a rebuilt pool); HiSparse's tier starts empty again.
    pub fn clear(&mut self) -> Result<()> {
        if let Some(t) = self.hisparse.as_deref_mut() {
            t.reset()?;
        }
        self.reqs.clear();
        for m in &mut self.managers {
            m.reqs.clear();
        }
        Ok(())
    }
}
