//! The coordinator's per-group calls for HiSparse's kinds (vLLM's `HiSparseSourceManager`,
//! `HiSparseResidentManager`, `HiSparseHotManager` bound to a `HiSparseCoordinator`, 0.32 to
//! 0.34): each call takes the group's pool (the tier's host pool for the source group, the
//! device pool otherwise), applies the kind's rule ([`super::hisparse`]) and then makes the
//! residency call vLLM's manager makes there. After every device allocation the device
//! pool's fired reuse watchers are drained into the residency, as vLLM's watcher runs inside
//! `get_new_blocks` (a page lost while one group allocates asks for a hot region before the
//! hot groups allocate).

use crate::error::{Error, Result};
use crate::hashing::source::HashSource;
use crate::hisparse::residency::{Residency, RESIDENCY_WATCHER};
use crate::manager::coordinator::Coordinator;
use crate::manager::group_state::{cdiv, ReqInfo, ReqState};
use crate::manager::hisparse::{self as rules, ImportStep};
use crate::manager::hisparse_tier::{HiSparseTier, TierEnv};
use crate::manager::spec::Kind;
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};

fn no_tier() -> Error {
    Error::State("a HiSparse group without the manager's HiSparse tier".into())
}

/// vLLM's `assert not new_computed_blocks` of the resident and hot managers.
fn no_hits(kind: Kind, new_computed: &[u32]) -> Result<()> {
    if new_computed.is_empty() {
        Ok(())
    } else {
        Err(Error::Assertion(format!("{kind:?} groups never have prefix-cache hits")))
    }
}

impl Coordinator {
    /// Bind the tier's host pool to `device`'s KV event queue (see
    /// [`HiSparseTier::bind_device`]); a no-op without a tier.
    pub fn bind_device_pool(&mut self, device: &mut BlockPool) {
        if let Some(t) = self.hisparse.as_deref_mut() {
            t.bind_device(device);
        }
    }

    /// Move the host pool's events into `device`'s queue (a no-op without a tier).
    pub fn move_host_events(&mut self, device: &mut BlockPool) {
        if let Some(t) = self.hisparse.as_deref_mut() {
            t.move_events(device);
        }
    }

    /// Set vLLM 0.34's `import_step_tokens`, which vLLM's connector passes to the first
    /// `get_hisparse_coordinator` call, before any request is admitted. Errors: no tier or a
    /// release without import reservations (`ValueError`), a request already admitted
    /// (`AssertionError`, as vLLM's memoised coordinator refuses another value). Nothing
    /// changes on error.
    pub fn set_hisparse_import_step_tokens(&mut self, import_step_tokens: usize) -> Result<()> {
        let admitted = self.reqs.live_slots().next().is_some();
        let tier = self.hisparse.as_deref_mut().ok_or_else(no_tier)?;
        if tier.import_step_tokens.is_none() {
            return Err(Error::Value("import_step_tokens: this vLLM release's HiSparse coordinator has none".into()));
        }
        if tier.import_step_tokens == Some(import_step_tokens) {
            return Ok(());
        }
        if admitted {
            return Err(Error::Assertion(
                "HiSparse import_step_tokens cannot change once a request has been admitted".into(),
            ));
        }
        tier.import_step_tokens = Some(import_step_tokens);
        tier.residency.set_import_step_tokens(import_step_tokens);
        Ok(())
    }

    /// The tier, if the manager has HiSparse groups.
    pub fn hisparse(&self) -> Option<&HiSparseTier> {
        self.hisparse.as_deref()
    }

    /// The pool group `gid`'s block ids belong to: the host pool for HiSparse's source group,
    /// `device` otherwise.
    pub fn pool_of<'p>(&'p self, gid: usize, device: &'p BlockPool) -> &'p BlockPool {
        match &self.hisparse {
            Some(t) if t.host_group() == gid => &t.host,
            _ => device,
        }
    }

    /// Run `f` on the residency with its view of this coordinator and `device` (None without
    /// a tier), after draining the reuse watchers that fired since the last call. Publication
    /// inputs the residency no longer owes, of requests no longer held, are dropped afterwards.
    pub fn with_residency<R>(
        &mut self,
        device: &mut BlockPool,
        f: impl FnOnce(&mut Residency, &mut TierEnv<'_>) -> Result<R>,
    ) -> Result<Option<R>> {
        let Coordinator { managers, reqs, hisparse, .. } = self;
        let Some(tier) = hisparse.as_deref_mut() else { return Ok(None) };
        let (out, memo) = {
            let (residency, mut env) = tier.split(managers, reqs, device);
            let fired = env.device_fired();
            if !fired.is_empty() {
                residency.on_blocks_reused(&env, &fired);
            }
            let out = f(residency, &mut env);
            (out, env.into_memo_buf())
        };
        tier.keep_memo_buf(memo);
        tier.collect_publications(reqs);
        tier.move_events(device);
        out.map(Some)
    }

    /// Hand the device pool's fired residency watchers to the residency (pages whose
    /// released blocks the pool handed out are lost). A no-op without a tier.
    pub fn drain_reuse_watchers(&mut self, device: &mut BlockPool) -> Result<()> {
        if self.hisparse.is_some() {
            self.with_residency(device, |_, _| Ok(()))?;
        }
        Ok(())
    }

    /// `get_num_blocks_to_allocate` of HiSparse group `gid` (device blocks; the source
    /// group's admission sentinel when the host pool cannot back the request). The source
    /// group on 0.34 sizes an external import (`size_import`).
    #[allow(clippy::too_many_arguments)] // vLLM's signature plus the group
    pub(crate) fn hisparse_num_blocks(
        &mut self,
        device: &BlockPool,
        gid: usize,
        slot: usize,
        request_id: &str,
        num_tokens: usize,
        new_computed: &[u32],
        total_computed: usize,
        num_local_computed: usize,
        apply_admission_cap: bool,
    ) -> Result<usize> {
        let Coordinator { managers, hisparse, .. } = self;
        let tier = hisparse.as_deref_mut().ok_or_else(no_tier)?;
        let m = &mut managers[gid];
        m.ensure_slot(slot);
        let st = &m.reqs[slot];
        match m.cfg.spec.kind {
            Kind::HiSparseSource => {
                let import_step = tier.import_step_tokens.map(|t| ImportStep {
                    import_step_tokens: t,
                    reserved_import_pages: tier.residency.reserved_import_pages(),
                });
                let c = rules::source_num_blocks_to_allocate(
                    &m.cfg,
                    &tier.host,
                    st,
                    num_tokens,
                    new_computed,
                    total_computed,
                    num_local_computed,
                    apply_admission_cap,
                    device.num_blocks(),
                    import_step,
                )?;
                if let Some(pages) = c.size_import {
                    tier.residency.size_import(request_id, pages);
                }
                Ok(c.blocks)
            }
            kind @ Kind::HiSparseResident => {
                no_hits(kind, new_computed)?;
                let k = tier.role_index(gid)?;
                let overlay = tier.residency.residency_changes(k).get(request_id);
                Ok(rules::resident_num_blocks_to_allocate(
                    &m.cfg,
                    st,
                    overlay,
                    num_tokens,
                    total_computed,
                    num_local_computed,
                    apply_admission_cap,
                ))
            }
            kind @ Kind::HiSparseHot { blocks_per_request } => {
                no_hits(kind, new_computed)?;
                let k = tier.role_index(gid)?;
                let required = tier.residency.hot_required(k).contains(request_id);
                Ok(rules::hot_num_blocks_to_allocate(
                    st,
                    blocks_per_request,
                    required,
                    total_computed,
                    num_local_computed,
                ))
            }
            _ => Err(Error::State(format!("kv_cache_groups[{gid}] is not a HiSparse group"))),
        }
    }

    /// For [`crate::manager::kv_cache_manager::KVCacheManager::allocate_is_noop_at`]: true if
    /// HiSparse group `gid`'s table for the request in `slot` already covers `need_slot`
    /// tokens, so that its count is 0 and its `allocate_new_blocks` takes nothing and changes
    /// nothing (a running request, no hit adopted, no external tokens): the source and
    /// resident groups' tables reach `need_slot` (a resident table holds every page, host-only
    /// ones as the null block); a hot group's request is running (`num_cached_block` 0) and
    /// either needs no hot region or holds all of it. False without the tier, for another
    /// kind, and whenever the device pool has fired watchers the residency has not drained
    /// yet is not known here (the caller checks those).
    pub(crate) fn hisparse_tables_cover(&self, gid: usize, slot: usize, need_slot: usize) -> bool {
        let Some(tier) = self.hisparse.as_deref() else { return false };
        let m = &self.managers[gid];
        let Some(r) = m.req(slot) else { return false };
        match m.cfg.spec.kind {
            Kind::HiSparseSource | Kind::HiSparseResident => {
                r.present && r.partial_hit.is_none() && r.blocks.len().saturating_mul(m.cfg.block_size) >= need_slot
            }
            Kind::HiSparseHot { blocks_per_request } => {
                if r.num_cached != Some(0) {
                    return false;
                }
                let (Ok(k), Some(id)) = (tier.role_index(gid), self.reqs.id_at(slot as u32)) else { return false };
                !tier.residency.hot_required(k).contains(id)
                    || (r.present && rules::hot_num_required_blocks(r, blocks_per_request) == 0)
            }
            _ => false,
        }
    }

    /// For [`crate::manager::kv_cache_manager::KVCacheManager::allocate_is_noop_at`]: true if
    /// the source group `gid`'s `cache_blocks(request, num_tokens)` (the coordinator's
    /// `publish_when_ready`) would change nothing for the request in `slot`: its host blocks
    /// of those tokens are cached already and the residency has nothing to publish or record
    /// ([`Residency::publication_settled`]).
    pub(crate) fn hisparse_publication_settled(&self, gid: usize, slot: usize, num_tokens: usize) -> bool {
        let Some(tier) = self.hisparse.as_deref() else { return false };
        let m = &self.managers[gid];
        let Some(r) = m.req(slot) else { return false };
        let n = self.num_cacheable_tokens(num_tokens, gid);
        if r.num_cached.unwrap_or(0) < n / m.cfg.block_size {
            return false;
        }
        let Some(id) = self.reqs.id_at(slot as u32) else { return false };
        let held = if r.present { r.blocks.len() } else { 0 };
        tier.residency.publication_settled(id, n, held)
    }

    /// Device blocks HiSparse group `gid` takes in `allocate_new_computed_blocks` (when
    /// `phase_a`: the request adopts) and `allocate_new_blocks` (see
    /// [`Coordinator::blocks_taken`]): the source group takes host blocks only.
    #[allow(clippy::too_many_arguments)] // the allocation's arguments
    pub(crate) fn hisparse_blocks_taken(
        &self,
        gid: usize,
        current: &ReqState,
        request_id: &str,
        phase_a: bool,
        num_local_computed: usize,
        num_external: usize,
        num_tokens: usize,
    ) -> usize {
        let Some(tier) = self.hisparse.as_deref() else { return 0 };
        let m = &self.managers[gid];
        let bs = m.cfg.block_size;
        match m.cfg.spec.kind {
            Kind::HiSparseResident => {
                let Ok(k) = tier.role_index(gid) else { return 0 };
                let overlay = tier.residency.residency_changes(k).get(request_id);
                let mut sim = current.clone();
                let mut need = 0;
                if phase_a {
                    sim.present = true;
                    sim.blocks = vec![NULL_BLOCK; cdiv(num_local_computed, bs)];
                    if num_external > 0 {
                        need += rules::resident_external_blocks_needed(
                            &m.cfg,
                            &sim,
                            overlay,
                            num_local_computed,
                            num_external,
                        );
                        let tail = (num_local_computed + num_external - 1) / bs;
                        if sim.blocks.len() <= tail {
                            sim.blocks.resize(tail + 1, NULL_BLOCK);
                        }
                    }
                }
                let have = if sim.present { sim.blocks.len() } else { 0 };
                need + cdiv(num_tokens, bs).saturating_sub(have)
            }
            Kind::HiSparseHot { blocks_per_request } => {
                let Ok(k) = tier.role_index(gid) else { return 0 };
                let required = tier.residency.hot_required(k).contains(request_id)
                    || (phase_a && (num_local_computed > 0 || !tier.has_resident_groups() || num_external > 0));
                if required {
                    rules::hot_num_required_blocks(current, blocks_per_request)
                } else {
                    0
                }
            }
            _ => 0,
        }
    }

    /// `add_local_computed_blocks` of HiSparse group `gid`: the source group's hits adopted
    /// on the host pool; a resident group's host pages, then `commit_computed_blocks`; a hot
    /// group's `require_hot` when a host prefix is read.
    #[allow(clippy::too_many_arguments)] // vLLM's signature plus the group
    pub(crate) fn hisparse_add_local(
        &mut self,
        device: &mut BlockPool,
        gid: usize,
        slot: usize,
        request_id: &str,
        new_computed: &[u32],
        num_local_computed: usize,
        num_external: usize,
    ) -> Result<()> {
        let kind = self.managers[gid].cfg.spec.kind;
        self.managers[gid].ensure_slot(slot);
        match kind {
            Kind::HiSparseSource => {
                let Coordinator { managers, hisparse, .. } = self;
                let tier = hisparse.as_deref_mut().ok_or_else(no_tier)?;
                managers[gid].add_local_computed_blocks(
                    &mut tier.host,
                    slot,
                    new_computed,
                    num_local_computed,
                    num_external,
                )
            }
            Kind::HiSparseResident => {
                no_hits(kind, new_computed)?;
                let m = &mut self.managers[gid];
                let pages = rules::resident_add_local_computed_blocks(&m.cfg, &mut m.reqs[slot], num_local_computed)?;
                self.with_residency(device, |res, env| {
                    res.commit_computed_blocks(env, request_id, pages);
                    Ok(())
                })?;
                Ok(())
            }
            Kind::HiSparseHot { .. } => {
                no_hits(kind, new_computed)?;
                let Coordinator { managers, hisparse, .. } = self;
                let tier = hisparse.as_deref_mut().ok_or_else(no_tier)?;
                let k = tier.role_index(gid)?;
                let has_resident = tier.has_resident_groups();
                if rules::hot_add_local_computed_blocks(&mut managers[gid].reqs[slot], num_local_computed, has_resident)
                {
                    tier.residency.require_hot(k, request_id);
                }
                Ok(())
            }
            _ => Err(Error::State(format!("kv_cache_groups[{gid}] is not a HiSparse group"))),
        }
    }

    /// `allocate_external_computed_blocks` of HiSparse group `gid` (`num_external > 0`): the
    /// source group records the pending host import and allocates host blocks; a resident
    /// group gives the import's last page a writable device block; a hot group requires its
    /// region.
    #[allow(clippy::too_many_arguments)] // vLLM's signature plus the group
    pub(crate) fn hisparse_external(
        &mut self,
        device: &mut BlockPool,
        gid: usize,
        slot: usize,
        request_id: &str,
        num_local_computed: usize,
        num_external: usize,
        record_for_zeroing: bool,
    ) -> Result<()> {
        let kind = self.managers[gid].cfg.spec.kind;
        self.managers[gid].ensure_slot(slot);
        let Coordinator { managers, hisparse, .. } = self;
        let tier = hisparse.as_deref_mut().ok_or_else(no_tier)?;
        match kind {
            Kind::HiSparseSource => {
                if num_external == 0 {
                    return Ok(());
                }
                tier.residency.record_pending_host_import(request_id, num_local_computed + num_external);
                managers[gid].allocate_external_computed_blocks(
                    &mut tier.host,
                    slot,
                    num_local_computed,
                    num_external,
                    record_for_zeroing,
                )?;
                tier.move_events(device);
                if tier.import_step_tokens.is_some() {
                    // 0.34: the import's reservation shrinks by the host pages now held
                    let held = managers[gid].req(slot).map_or(0, |r| r.blocks.len());
                    tier.residency.update_import_reservation(request_id, held);
                }
                Ok(())
            }
            Kind::HiSparseResident => {
                let k = tier.role_index(gid)?;
                let m = &mut managers[gid];
                let overlay = tier.residency.residency_changes(k).get(request_id);
                rules::resident_allocate_external_computed_blocks(
                    &m.cfg,
                    device,
                    &mut m.reqs[slot],
                    overlay,
                    num_local_computed,
                    num_external,
                )?;
                self.drain_reuse_watchers(device)
            }
            Kind::HiSparseHot { .. } => {
                let k = tier.role_index(gid)?;
                tier.residency.require_hot(k, request_id);
                Ok(())
            }
            _ => Err(Error::State(format!("kv_cache_groups[{gid}] is not a HiSparse group"))),
        }
    }

    /// `allocate_new_blocks` of HiSparse group `gid`: host blocks for the source group; the
    /// resident group's blocks up to `num_tokens`; a hot group's region when required. The
    /// reuse watchers the device allocation fired are drained.
    pub(crate) fn hisparse_allocate_new(
        &mut self,
        device: &mut BlockPool,
        gid: usize,
        slot: usize,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
    ) -> Result<Vec<u32>> {
        let kind = self.managers[gid].cfg.spec.kind;
        self.managers[gid].ensure_slot(slot);
        let Coordinator { managers, hisparse, .. } = self;
        let tier = hisparse.as_deref_mut().ok_or_else(no_tier)?;
        let out = match kind {
            Kind::HiSparseSource => {
                let new = managers[gid].allocate_new_blocks(
                    &mut tier.host,
                    slot,
                    request_id,
                    num_tokens,
                    num_tokens_main_model,
                )?;
                tier.move_events(device);
                if !new.is_empty() && tier.import_step_tokens.is_some() {
                    // 0.34: `update_import_reservation(request, len(req_to_blocks[request]))`
                    let held = managers[gid].req(slot).map_or(0, |r| r.blocks.len());
                    tier.residency.update_import_reservation(request_id, held);
                }
                return Ok(new);
            }
            Kind::HiSparseResident => {
                let m = &mut managers[gid];
                rules::resident_allocate_new_blocks(&m.cfg, device, &mut m.reqs[slot], num_tokens)?
            }
            Kind::HiSparseHot { blocks_per_request } => {
                let k = tier.role_index(gid)?;
                let required = tier.residency.hot_required(k).contains(request_id);
                rules::hot_allocate_new_blocks(device, &mut managers[gid].reqs[slot], blocks_per_request, required)?
            }
            _ => return Err(Error::State(format!("kv_cache_groups[{gid}] is not a HiSparse group"))),
        };
        self.drain_reuse_watchers(device)?;
        Ok(out)
    }

    /// The source group's `cache_blocks(request, num_tokens)`: the coordinator's
    /// `publish_when_ready` (the host blocks of the durable prefix now, the rest as spills
    /// complete), the request's hashes kept for it.
    #[allow(clippy::too_many_arguments)] // vLLM's signature
    pub(crate) fn hisparse_cache(
        &mut self,
        device: &mut BlockPool,
        req: &ReqInfo<'_>,
        hashes: &dyn HashSource,
        num_tokens: usize,
        retention_interval: Option<usize>,
        replay_boundaries: &[usize],
    ) -> Result<()> {
        let tier = self.hisparse.as_deref_mut().ok_or_else(no_tier)?;
        tier.keep_publication(req, hashes, num_tokens, retention_interval, replay_boundaries)?;
        let id = req.request_id;
        self.with_residency(device, |res, env| res.publish_when_ready(env, id, num_tokens))?;
        Ok(())
    }

    /// `free` of HiSparse group `gid`: the coordinator's `free(request)` first (source and
    /// resident groups; `finished`: `request.is_finished()`), then the group's blocks back to
    /// its pool, tail first (a resident group's row with its overlay, null head trimmed from
    /// 0.33; a hot group's region, `hot_required` dropped).
    pub(crate) fn hisparse_free(
        &mut self,
        device: &mut BlockPool,
        gid: usize,
        slot: usize,
        request_id: &str,
        finished: bool,
    ) -> Result<()> {
        let blocks = self.hisparse_pop(device, gid, slot, request_id, finished)?;
        let kind = self.managers[gid].cfg.spec.kind;
        let rev: Vec<u32> = blocks.into_iter().rev().collect();
        if kind == Kind::HiSparseSource {
            let tier = self.hisparse.as_deref_mut().ok_or_else(no_tier)?;
            tier.host.free_blocks(&rev, true)
        } else {
            device.free_blocks(&rev, true)
        }
    }

    /// `pop_blocks_for_free` of HiSparse group `gid` (see [`Coordinator::hisparse_free`]): the
    /// group's blocks (host block ids for the source group), the request forgotten there.
    pub(crate) fn hisparse_pop(
        &mut self,
        device: &mut BlockPool,
        gid: usize,
        slot: usize,
        request_id: &str,
        finished: bool,
    ) -> Result<Vec<u32>> {
        let kind = self.managers[gid].cfg.spec.kind;
        self.managers[gid].ensure_slot(slot);
        if matches!(kind, Kind::HiSparseSource | Kind::HiSparseResident) {
            self.with_residency(device, |res, env| res.free(env, request_id, finished))?;
        }
        let Coordinator { managers, hisparse, .. } = self;
        let tier = hisparse.as_deref_mut().ok_or_else(no_tier)?;
        let m = &mut managers[gid];
        match kind {
            Kind::HiSparseSource => Ok(m.pop_blocks_for_free(slot, request_id)),
            Kind::HiSparseResident => {
                let k = tier.role_index(gid)?;
                let overlay = tier.residency.residency_changes(k).get(request_id);
                let row = rules::resident_pop_blocks_for_free(&mut m.reqs[slot], overlay, tier.trim_null_head);
                tier.residency.forget_overlay_of(k, request_id);
                Ok(row)
            }
            Kind::HiSparseHot { .. } => {
                let k = tier.role_index(gid)?;
                tier.residency.release_hot(k, request_id);
                Ok(m.pop_blocks_for_free(slot, request_id))
            }
            _ => Err(Error::State(format!("kv_cache_groups[{gid}] is not a HiSparse group"))),
        }
    }
}

impl Coordinator {
    /// The source group's `take_host_cow_copies()`: its pending copy-on-write `(source,
    /// copy)` host block pairs, drained (vLLM's `HiSparseSourceManager` keeps them out of
    /// `take_pending_cow_copies`, the worker's device copy path). Empty without a tier.
    pub fn hisparse_take_host_cow_copies(&mut self) -> Vec<(u32, u32)> {
        let Some(gid) = self.hisparse.as_deref().map(HiSparseTier::host_group) else { return Vec::new() };
        self.managers.get_mut(gid).map(|m| m.take_pending_cow_copies()).unwrap_or_default()
    }

    /// The coordinator's `take_host_block_copies()`: the host copies drained (see
    /// [`Coordinator::hisparse_take_host_cow_copies`]) and retained in the residency, both
    /// endpoints, until `release_completed_host_copies` (then `has_pending_work()` is true).
    /// Empty without a tier.
    pub fn hisparse_take_host_block_copies(&mut self) -> Vec<(u32, u32)> {
        let pairs = self.hisparse_take_host_cow_copies();
        if let Some(tier) = self.hisparse.as_deref_mut() {
            tier.residency.retain_host_copies(&pairs);
        }
        pairs
    }

    /// `pop_blocks_for_free(request_id)` of a manager with HiSparse groups: every group's
    /// blocks in group order, each with whether it is a host block (the source group's,
    /// which the caller frees into the host pool, as vLLM's `free_blocks` routes by
    /// `block.pool`); the request forgotten everywhere and the coordinator's
    /// `free(request)` made (`finished`: `request.is_finished()`, so a finished request's
    /// running spills keep their host pages until they publish). Without HiSparse groups
    /// every block is a device block.
    pub fn pop_blocks_for_free_routed(
        &mut self,
        device: &mut BlockPool,
        request_id: &str,
        finished: bool,
    ) -> Result<Vec<(u32, bool)>> {
        let Some(slot) = self.slot(request_id) else {
            return Ok(Vec::new());
        };
        let host_group = self.hisparse.as_deref().map(HiSparseTier::host_group);
        let mut out = Vec::new();
        for i in 0..self.managers.len() {
            let blocks = if self.managers[i].cfg.spec.kind.is_hisparse() {
                self.hisparse_pop(device, i, slot, request_id, finished)?
            } else {
                self.managers[i].pop_blocks_for_free(slot, request_id)
            };
            let host = host_group == Some(i);
            out.extend(blocks.into_iter().map(|b| (b, host)));
        }
        self.release_if_vacant(request_id);
        Ok(out)
    }
}

impl TierEnv<'_> {
    /// The device blocks whose residency watcher fired since the last drain.
    pub fn device_fired(&mut self) -> Vec<u32> {
        crate::hisparse::residency::Env::device(self).take_fired_watchers_of(RESIDENCY_WATCHER)
    }
}

#[cfg(test)]
#[path = "coordinator_hisparse/tests.rs"]
mod tests;
