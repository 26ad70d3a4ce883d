//! The manager's HiSparse tier: the host pool HiSparse's source group allocates from, the
//! coordinator's books ([`Residency`]) and what the books read of the manager (its block
//! tables, its two pools, the host group's publication), as vLLM's `HiSparseCoordinator`
//! binds itself to a `KVCacheManager`'s HiSparse managers (`bind_host_pool`, 0.32 to 0.34).
//!
//! The coordinator ([`super::coordinator`]) holds one [`HiSparseTier`] when a group is
//! HiSparse's and dispatches the HiSparse kinds to the rules of [`super::hisparse`], calling
//! the residency where vLLM's managers call their coordinator. [`TierEnv`] is the residency's
//! [`Env`] over the coordinator's tables.

use std::cell::{Cell, RefCell};

use hashbrown::HashMap;

use crate::error::{Error, Result};
use crate::hashing::source::{HashSource, ScaledHashes};
use crate::hashing::Digest;
use crate::hisparse::residency::{Env, Layout, Residency};
use crate::manager::group_state::{ReqInfo, TypeManager};
use crate::manager::requests::RequestTable;
use crate::manager::spec::ManagerConfig;
use crate::pool::block_pool::BlockPool;
use crate::pool::events::Medium;

/// What a pending host publication reads of its request (vLLM's `_PendingPublication` keeps
/// the request itself): its hashes at the hash block size, as far as the publication can
/// reach, and the request fields the host group's `cache_blocks` reads.
#[derive(Clone, Debug, Default)]
pub struct PublishInputs {
    /// The request's block hashes (hash block size), a prefix of them.
    pub hashes: Vec<Digest>,
    pub num_prompt_tokens: usize,
    pub shared_prefix_boundary: usize,
    pub event_tag: u64,
    pub retention_interval: Option<usize>,
    pub replay_boundaries: Vec<usize>,
}

/// The host pool and the residency of a manager with HiSparse groups.
#[derive(Clone)]
pub struct HiSparseTier {
    /// The host pool (`SharedEventQueueBlockPool`, medium CPU): the source group's blocks.
    pub host: BlockPool,
    /// The coordinator's books.
    pub residency: Residency,
    /// 0.34's `import_step_tokens` (None before 0.34).
    pub import_step_tokens: Option<usize>,
    /// `pop_blocks_for_free` of a resident group trims its null head (0.33+).
    pub trim_null_head: bool,
    /// Per group index: its resident index `k` (resident groups) or hot index (hot groups).
    roles: Vec<Option<usize>>,
    /// The inputs of the publications the residency still owes, by request.
    publications: HashMap<String, PublishInputs>,
    /// How many of `publications` may belong to requests the manager no longer holds (an
    /// upper bound; [`HiSparseTier::collect_publications`] looks only when it is not 0).
    num_detached: usize,
    /// What the tier was built from, to rebuild it empty.
    host_caching: bool,
    hash_block_size: usize,
    /// KV events on (the device pool's `enable_kv_cache_events`, set by `bind_device`).
    host_events: bool,
    /// The string of [`TierEnv`]'s slot memo, kept between calls with its capacity (no
    /// allocation per call); its contents mean nothing between calls.
    memo_buf: String,
}

impl std::fmt::Debug for HiSparseTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiSparseTier")
            .field("host_num_blocks", &self.host.num_blocks())
            .field("host_free_blocks", &self.host.num_free_blocks())
            .field("residency", &self.residency)
            .field("import_step_tokens", &self.import_step_tokens)
            .field("kept_publications", &self.publications.len())
            .finish()
    }
}

impl HiSparseTier {
    /// The tier of `cfg`, None without HiSparse groups. Built as vLLM's
    /// `HiSparseCoordinator(...)` is: the layout's errors in vLLM's order
    /// ([`Layout::from_config`], [`Residency::new`]), then the host pool of
    /// `hisparse_host_num_blocks` blocks, caching when the manager caches and the source group
    /// is prefix-cacheable. Errors: vLLM's `ValueError`s and assertions; a bad host size as the
    /// pool's `ValueError`. Nothing is kept on error.
    pub fn from_config(cfg: &ManagerConfig) -> Result<Option<Self>> {
        let import_step = cfg.hisparse_import_step_tokens;
        let Some(layout) = Layout::from_config(cfg, cfg.hisparse_host_num_blocks, import_step.unwrap_or(0))? else {
            return Ok(None);
        };
        let host_num_blocks = cfg
            .hisparse_host_num_blocks
            .ok_or_else(|| Error::Value("HiSparse host group needs host capacity.".into()))?;
        let source = &cfg.groups[layout.host_group];
        let host_caching = cfg.enable_caching && source.prefix_cacheable;
        let mut roles = vec![None; cfg.groups.len()];
        for (k, &g) in layout.resident_groups.iter().enumerate() {
            roles[g] = Some(k);
        }
        for (k, &(g, _)) in layout.hot_groups.iter().enumerate() {
            roles[g] = Some(k);
        }
        let residency = Residency::new(layout)?;
        // events off until the device pool is bound (`bind_device`): vLLM's host pool writes
        // into the device pool's queue, with the device pool's `enable_kv_cache_events`
        let host = BlockPool::new(host_num_blocks, host_caching, cfg.hash_block_size, false)?;
        Ok(Some(HiSparseTier {
            host,
            residency,
            import_step_tokens: import_step,
            trim_null_head: cfg.rules.hisparse_trim_null_head,
            roles,
            publications: HashMap::new(),
            num_detached: 0,
            host_caching,
            hash_block_size: cfg.hash_block_size,
            host_events: false,
            memo_buf: String::new(),
        }))
    }

    /// The source (host) group.
    pub fn host_group(&self) -> usize {
        self.residency.layout().host_group
    }

    /// Group `gid`'s index among the resident groups, or among the hot groups (by its kind).
    pub fn role_index(&self, gid: usize) -> Result<usize> {
        self.roles
            .get(gid)
            .copied()
            .flatten()
            .ok_or_else(|| Error::State(format!("kv_cache_groups[{gid}] is not a HiSparse resident or hot group")))
    }

    /// True if the layout has resident groups (`coordinator.resident_managers`).
    pub fn has_resident_groups(&self) -> bool {
        !self.residency.layout().resident_groups.is_empty()
    }

    /// Keep what `request`'s publication of `num_tokens` reads (its hashes up to there),
    /// before [`Residency::publish_when_ready`]. Hashes kept earlier stay (a request's
    /// hashes only grow), so a running request's call digests only its new full blocks.
    pub fn keep_publication(
        &mut self,
        req: &ReqInfo<'_>,
        hashes: &dyn HashSource,
        num_tokens: usize,
        retention_interval: Option<usize>,
        replay_boundaries: &[usize],
    ) -> Result<()> {
        let want = (num_tokens / self.hash_block_size).min(hashes.len());
        let kept = self.publications.get(req.request_id).map_or(0, |p| p.hashes.len());
        // read (and checked) before anything is kept: an error keeps nothing new
        let mut more = Vec::with_capacity(want.saturating_sub(kept));
        for i in kept..want {
            more.push(hashes.digest(i)?);
        }
        let p = match self.publications.get_mut(req.request_id) {
            Some(p) => p,
            None => self.publications.entry(req.request_id.to_string()).or_default(),
        };
        p.hashes.extend(more);
        p.num_prompt_tokens = req.num_prompt_tokens;
        p.shared_prefix_boundary = req.shared_prefix_boundary;
        p.event_tag = req.event_tag;
        p.retention_interval = retention_interval;
        if p.replay_boundaries != replay_boundaries {
            p.replay_boundaries = replay_boundaries.to_vec();
        }
        Ok(())
    }

    /// Drop the inputs of publications the residency no longer owes, of requests `reqs` no
    /// longer holds (a running request's stay: its next publication extends them).
    pub fn collect_publications(&mut self, reqs: &RequestTable<()>) {
        if self.num_detached == 0 {
            return;
        }
        let residency = &self.residency;
        self.publications.retain(|r, _| reqs.slot(r).is_some() || residency.has_publication(r));
        self.num_detached = self.publications.keys().filter(|r| reqs.slot(r).is_none()).count();
    }

    /// Drop the inputs of `request` (no longer held) unless its publication is still owed.
    pub fn collect_publication(&mut self, request: &str) {
        if self.publications.contains_key(request) {
            if self.residency.has_publication(request) {
                self.num_detached += 1;
            } else {
                self.publications.remove(request);
            }
        }
    }

    /// The event tags of the kept publication inputs (owed publications' host events come
    /// later; a running request's latest tag is kept with its inputs).
    pub fn publication_tags(&self) -> Vec<u64> {
        self.publications.values().map(|p| p.event_tag).filter(|&t| t != 0).collect()
    }

    /// Requests whose publication inputs are kept (for tests and the binding).
    pub fn num_kept_publications(&self) -> usize {
        self.publications.len()
    }

    /// Share `device`'s KV event queue, as vLLM's host pool (`SharedEventQueueBlockPool`) does:
    /// the host pool records events when the device pool does, with medium CPU, stamped so
    /// [`HiSparseTier::move_events`] puts them into the device pool's queue in recording order.
    pub fn bind_device(&mut self, device: &mut BlockPool) {
        self.host_events = device.events_enabled();
        if self.host_events {
            device.set_event_sharing(true, device.medium(), true);
            self.host.set_event_sharing(true, Medium::Host, true);
        }
    }

    /// Take back the string of a [`TierEnv`]'s slot memo ([`TierEnv::into_memo_buf`]).
    pub fn keep_memo_buf(&mut self, buf: String) {
        self.memo_buf = buf;
    }

    /// Move the host pool's buffered events into `device`'s queue, in recording order.
    pub fn move_events(&mut self, device: &mut BlockPool) {
        device.absorb_events(&mut self.host);
    }

    /// Forget everything (a rebuilt device pool): an empty residency and host pool. The host
    /// pool's residency metrics stay on (rate, generator and pending events kept; no block
    /// sampled).
    pub fn reset(&mut self) -> Result<()> {
        let residency = Residency::new(self.residency.layout().clone())?;
        let mut host = BlockPool::new(self.host.num_blocks(), self.host_caching, self.hash_block_size, false)?;
        if self.host_events {
            host.set_event_sharing(true, Medium::Host, true);
        }
        if let Some(metrics) = self.host.residency() {
            let mut metrics = metrics.clone();
            metrics.clear_samples();
            host.restore_residency(metrics)?;
        }
        self.residency = residency;
        self.host = host;
        self.publications.clear();
        self.num_detached = 0;
        Ok(())
    }

    /// Split the tier for a residency call over the coordinator's tables: the residency and
    /// its [`TierEnv`].
    pub fn split<'a>(
        &'a mut self,
        managers: &'a mut [TypeManager],
        reqs: &'a RequestTable<()>,
        device: &'a mut BlockPool,
    ) -> (&'a mut Residency, TierEnv<'a>) {
        let host_group = self.residency.layout().host_group;
        let HiSparseTier { host, residency, publications, memo_buf, .. } = self;
        let memo = SlotMemo { id: RefCell::new(std::mem::take(memo_buf)), slot: Cell::new(None) };
        (residency, TierEnv { managers, reqs, device, host, publications, host_group, memo })
    }
}

/// The last request id [`TierEnv`] looked up and its slot: the residency asks for one
/// request's tables many times in a row, and the request table cannot change while the env
/// borrows it.
#[derive(Default)]
struct SlotMemo {
    id: RefCell<String>,
    slot: Cell<Option<Option<usize>>>,
}

/// The residency's [`Env`] over a coordinator: tables by group and request id, the device
/// pool the caller passes, the tier's host pool, and the host group's publication.
pub struct TierEnv<'a> {
    managers: &'a mut [TypeManager],
    reqs: &'a RequestTable<()>,
    device: &'a mut BlockPool,
    host: &'a mut BlockPool,
    publications: &'a HashMap<String, PublishInputs>,
    host_group: usize,
    memo: SlotMemo,
}

impl TierEnv<'_> {
    /// The slot memo's string, for [`HiSparseTier::keep_memo_buf`].
    pub fn into_memo_buf(self) -> String {
        self.memo.id.into_inner()
    }

    fn slot(&self, request: &str) -> Option<usize> {
        if let Some(slot) = self.memo.slot.get() {
            if self.memo.id.borrow().as_str() == request {
                return slot;
            }
        }
        let slot = self.reqs.slot(request).map(|s| s as usize);
        request.clone_into(&mut self.memo.id.borrow_mut());
        self.memo.slot.set(Some(slot));
        slot
    }
}

impl Env for TierEnv<'_> {
    fn table(&self, group: usize, request: &str) -> Option<&[u32]> {
        let r = self.managers.get(group)?.req(self.slot(request)?)?;
        r.present.then_some(r.blocks.as_slice())
    }
    fn num_cached(&self, group: usize, request: &str) -> usize {
        self.slot(request).and_then(|s| self.managers.get(group)?.req(s)).and_then(|r| r.num_cached).unwrap_or(0)
    }
    fn device(&mut self) -> &mut BlockPool {
        self.device
    }
    fn host(&mut self) -> &mut BlockPool {
        self.host
    }
    fn device_ref(&self) -> &BlockPool {
        self.device
    }
    fn host_ref(&self) -> &BlockPool {
        self.host
    }
    /// `HiSparseSourceManager.publish_blocks`: the full-attention `cache_blocks` of the host
    /// group on the host pool, with the kept inputs of the request's publication.
    fn publish(&mut self, request: &str, num_tokens: usize) -> Result<()> {
        let (Some(slot), Some(p)) = (self.slot(request), self.publications.get(request)) else {
            return Ok(());
        };
        let info = ReqInfo {
            request_id: request,
            num_prompt_tokens: p.num_prompt_tokens,
            num_computed_tokens: num_tokens,
            num_tokens: p.hashes.len() * self.host.hash_block_size(),
            shared_prefix_boundary: p.shared_prefix_boundary,
            event_tag: p.event_tag,
        };
        let m = self
            .managers
            .get_mut(self.host_group)
            .ok_or_else(|| Error::State("HiSparse host group out of range".into()))?;
        m.cache_blocks(self.host, slot, &info, &p.hashes, num_tokens, p.retention_interval, &p.replay_boundaries)
    }
    /// `_publish_detached_blocks`: the host pool's `cache_full_blocks` of a finished request's
    /// kept host blocks.
    fn publish_detached(&mut self, request: &str, blocks: &[u32], num_cached: usize, num_full: usize) -> Result<()> {
        let Some(p) = self.publications.get(request) else { return Ok(()) };
        let m = self
            .managers
            .get(self.host_group)
            .ok_or_else(|| Error::State("HiSparse host group out of range".into()))?;
        let (bs, gid) = (m.cfg.block_size, m.cfg.group_id);
        let view = ScaledHashes::new(&p.hashes, self.host.hash_block_size(), bs)?;
        let num_full = num_full.min(blocks.len()).min(view.len());
        self.host.cache_full_blocks(blocks, num_cached, num_full, &view, bs, gid, None, p.event_tag)
    }
}
