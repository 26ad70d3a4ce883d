//! The HiSparse coordinator's books (vLLM's `HiSparseCoordinator`, 0.32 to 0.34).
//!
//! A resident page (one block per resident group at one page index of a request) is, in
//! turn: **dirty** (only the GPU copy), **pending** (a spill planned or running: its host
//! block and its GPU blocks hold an extra reference), **clean** (`valid_pages`: the host copy
//! is complete), **pinned clean** (clean, the request still holds the GPU blocks) and
//! **unpinned** (released with `BlockPool::unpin_blocks`: free, still read until the pool
//! hands the block out; then the reuse watcher fires and the page is **lost**: the request
//! reads it from the host, the worker is told (`stale_pages`), and the hot groups are asked
//! for a hot region). Host blocks are published (cached under the request's hashes) up to the
//! clean prefix (`ready_prefix_pages`).
//!
//! Block tables stay the manager's: [`Env`] gives them, the two pools and the host group's
//! publication. The residency overlay of the resident groups (vLLM's `residency_changes`) is
//! kept here. Pages are page indices (token position / block size); block ids are the device
//! pool's except where named host.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use hashbrown::{HashMap, HashSet};

use crate::error::{Error, Result};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};
use crate::pool::cache_map::Key;

/// Sealed pages this many positions behind a resident table's tail stay pinned: a page an
/// in-flight step writes is never handed out under it (vLLM's `ACTIVE_TAIL_PAGES`).
pub const ACTIVE_TAIL_PAGES: usize = 2;

/// The watcher id the residency registers with the device pool's `unpin_blocks`; fired
/// entries carrying it go to [`Residency::on_blocks_reused`].
pub const RESIDENCY_WATCHER: u64 = u64::MAX;

/// What the residency reads and drives: the manager's block tables and its two pools.
pub trait Env {
    /// `req_to_blocks[request]` of `group` (block ids of that group's pool), None if the
    /// request holds no table there.
    fn table(&self, group: usize, request: &str) -> Option<&[u32]>;
    /// `num_cached_block[request]` of `group` (0 if none).
    fn num_cached(&self, group: usize, request: &str) -> usize;
    /// The device (GPU) pool.
    fn device(&mut self) -> &mut BlockPool;
    /// The host pool.
    fn host(&mut self) -> &mut BlockPool;
    /// Read-only device pool.
    fn device_ref(&self) -> &BlockPool;
    /// Read-only host pool.
    fn host_ref(&self) -> &BlockPool;
    /// The host group's `publish_blocks(request, num_tokens)`: cache the request's host
    /// blocks up to `num_tokens` (the caller keeps the request and the retention arguments
    /// of its pending publication).
    fn publish(&mut self, request: &str, num_tokens: usize) -> Result<()>;
    /// `cache_full_blocks` of a finished request's detached host blocks (`blocks`, of which
    /// `num_cached` are cached already) up to `num_full` blocks.
    fn publish_detached(&mut self, request: &str, blocks: &[u32], num_cached: usize, num_full: usize) -> Result<()>;
}

/// The configuration the coordinator reads from the KV-cache groups.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The `HISPARSE_SOURCE` group (its blocks are host blocks).
    pub host_group: usize,
    /// The host group's block size.
    pub host_block_size: usize,
    /// `HiSparseResidentSpec` groups, in group order.
    pub resident_groups: Vec<usize>,
    /// Their block sizes (one size for all, equal to the host's).
    pub resident_block_sizes: Vec<usize>,
    /// Their `max_admission_blocks_per_request`.
    pub resident_admission_caps: Vec<usize>,
    /// `HiSparseHotSpec` groups and their `blocks_per_request`.
    pub hot_groups: Vec<(usize, usize)>,
    /// `kv_cache_config.num_blocks`.
    pub num_blocks: usize,
    /// The manager's `max_model_len`.
    pub max_model_len: usize,
    /// The coordinator's `num_reprefillable_tokens`.
    pub num_reprefillable_tokens: usize,
    /// 0.34's `import_step_tokens` (0 before).
    pub import_step_tokens: usize,
}

/// A request's publication waiting for durable host pages (vLLM's `_PendingPublication`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Publication {
    pub num_computed_tokens: usize,
    pub num_pages: usize,
    /// A finished request's host blocks, kept until its last spill completes.
    pub detached_blocks: Option<Vec<u32>>,
    pub num_cached_blocks: usize,
}

/// One request's residency (vLLM's `_HiSparseRequestState`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestState {
    pub valid_pages: BTreeSet<usize>,
    pub ready_prefix_pages: usize,
    /// page -> transfer id of its running spill.
    pub pending_pages: BTreeMap<usize, u64>,
    pub publication: Option<Publication>,
    pub copies_recorded_blocks: usize,
    pub pinned_clean: BTreeSet<usize>,
    pub unpinned_pages: BTreeSet<usize>,
    pub pages_to_adopt: usize,
    pub synced_pages: usize,
    pub stale_pages: BTreeSet<usize>,
}

/// A planned copy of one page between the tiers (vLLM's `SparseKVPageTransfer`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub transfer_id: u64,
    pub host_block_id: u32,
    pub resident_block_ids: Vec<u32>,
    /// 0.32 / 0.33's `after_forward` (0.34 has no such field).
    pub after_forward: bool,
    pub restore: bool,
}

/// A spill the workers have not all completed (vLLM's `_PendingSpill`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingSpill {
    pub transfer_id: u64,
    /// The request id, shared with the residency's other books (no copy per spill).
    pub request: Arc<str>,
    pub page: usize,
    /// The [`RequestState`] it belongs to (a freed request's state lives on while spills of
    /// it run; a readmitted request has a new one).
    pub state: u64,
    pub host_block: u32,
    pub resident_blocks: CopyBlocks,
    pub restore: bool,
    pub expected_worker_completions: usize,
    pub worker_completions: usize,
    pub enqueue_applied: bool,
}

/// One span of rows to mirror into the host cache (vLLM's `SparseKVRowMirror`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowMirror {
    pub source_starts: Vec<usize>,
    pub destination_start: usize,
    pub num_rows: usize,
}

/// One [`RowMirror`] before its start list is built: the page's device block per resident
/// group and the first row's offset in the page (a source start is `block * block_size +
/// offset`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MirrorSpan {
    pub blocks: CopyBlocks,
    pub offset: usize,
    pub destination_start: usize,
    pub num_rows: usize,
}

impl MirrorSpan {
    /// The source starts, one per resident group.
    pub fn source_starts(&self, block_size: usize) -> impl ExactSizeIterator<Item = usize> + '_ {
        let off = self.offset;
        self.blocks.iter().map(move |&b| b as usize * block_size + off)
    }

    /// The span as a [`RowMirror`].
    pub fn mirror(&self, block_size: usize) -> RowMirror {
        RowMirror {
            source_starts: self.source_starts(block_size).collect(),
            destination_start: self.destination_start,
            num_rows: self.num_rows,
        }
    }
}

/// What the worker lacks of one request's residency (vLLM's `SparseKVResidencyUpdate`): the
/// pages and, per resident group, their block ids (the null block: read from the host).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidencyUpdate {
    pub pages: Vec<usize>,
    pub block_ids: Vec<Vec<u32>>,
}

/// The `(request, page)` pairs still reading one unpinned device block, kept sorted (by
/// request id, then page: the order they lose the page in). Mostly one pair: a sorted `Vec`
/// costs one small allocation where a `BTreeSet` would build a node.
#[derive(Clone, Debug, Default)]
struct Readers(Vec<(Arc<str>, usize)>);

impl Readers {
    fn find(&self, request: &str, page: usize) -> std::result::Result<usize, usize> {
        self.0.binary_search_by(|(r, p)| (&**r, *p).cmp(&(request, page)))
    }

    fn insert(&mut self, request: &Arc<str>, page: usize) {
        if let Err(i) = self.find(request, page) {
            self.0.insert(i, (Arc::clone(request), page));
        }
    }

    fn remove(&mut self, request: &str, page: usize) {
        if let Ok(i) = self.find(request, page) {
            self.0.remove(i);
        }
    }
}

/// How many resident groups' blocks a [`CopyBlocks`] holds without an allocation.
const INLINE_BLOCKS: usize = 3;

/// The device blocks holding one published host page, one per resident group (`copies`'
/// values): inline for up to `INLINE_BLOCKS` (3) groups, so reading or dropping a copy touches
/// only its map bucket; boxed past that. Reads as a slice of block ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyBlocks {
    Inline { len: u8, ids: [u32; INLINE_BLOCKS] },
    Boxed(Box<[u32]>),
}

impl From<&[u32]> for CopyBlocks {
    fn from(blocks: &[u32]) -> Self {
        if blocks.len() <= INLINE_BLOCKS {
            let mut ids = [0; INLINE_BLOCKS];
            ids[..blocks.len()].copy_from_slice(blocks);
            CopyBlocks::Inline { len: blocks.len() as u8, ids }
        } else {
            CopyBlocks::Boxed(blocks.into())
        }
    }
}

impl std::ops::Deref for CopyBlocks {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        match self {
            CopyBlocks::Inline { len, ids } => &ids[..*len as usize],
            CopyBlocks::Boxed(b) => b,
        }
    }
}

/// A value per device block id, in a vector indexed by the id (grown on demand): the
/// residency reads it for every block the device pool reuses, where a hashed lookup costs
/// cache misses on its control bytes and its bucket.
#[derive(Clone, Debug, Default)]
struct ByBlock<V>(Vec<V>);

impl<V: Default> ByBlock<V> {
    fn with_blocks(num_blocks: usize) -> Self {
        ByBlock(std::iter::repeat_with(V::default).take(num_blocks).collect())
    }

    fn get(&self, b: u32) -> Option<&V> {
        self.0.get(b as usize)
    }

    /// Block `b`'s value, if the vector reaches it (a block past it holds the default).
    fn get_mut(&mut self, b: u32) -> Option<&mut V> {
        self.0.get_mut(b as usize)
    }

    /// Block `b`'s value, the vector grown to reach it.
    fn entry(&mut self, b: u32) -> &mut V {
        let i = b as usize;
        if i >= self.0.len() {
            self.0.resize_with(i + 1, V::default);
        }
        &mut self.0[i]
    }

    /// Block `b`'s value, the default left in its place.
    fn take(&mut self, b: u32) -> V {
        self.get_mut(b).map(std::mem::take).unwrap_or_default()
    }
}

/// `table[start..]` with `overlay`'s blocks in place of the table's (vLLM's
/// `get_residency_row`): the table copied once and the overlay's entries within it written
/// over it, not one overlay lookup per page. Empty when `start` is past the table.
pub fn overlaid_row(table: &[u32], overlay: Option<&BTreeMap<usize, u32>>, start: usize) -> Vec<u32> {
    let Some(tail) = table.get(start..) else { return Vec::new() };
    let mut row = tail.to_vec();
    if let Some(o) = overlay {
        if !row.is_empty() {
            for (&p, &b) in o.range(start..table.len()) {
                row[p - start] = b;
            }
        }
    }
    row
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// The coordinator's state.
#[derive(Clone, Debug)]
pub struct Residency {
    layout: Layout,
    block_size: usize,
    max_spill_pages: usize,
    transition_watermark: usize,
    /// Per resident group: request -> page -> block read instead of the table's.
    changes: Vec<HashMap<String, BTreeMap<usize, u32>>>,
    /// Per hot group: the requests that need a hot region.
    hot_required: Vec<HashSet<String>>,
    states: HashMap<u64, RequestState>,
    /// Live request -> its state. The key is the one shared copy of the request id that the
    /// pending spills and `owners` hold too (cloning it allocates nothing).
    by_request: HashMap<Arc<str>, u64>,
    next_state: u64,
    pending: BTreeMap<u64, PendingSpill>,
    spills_to_send: Vec<Transfer>,
    next_spill_id: u64,
    /// Unpinned device block -> the (request, page) pairs still reading it.
    owners: ByBlock<Readers>,
    /// Published host key -> the device blocks holding that page, one per resident group.
    copies: HashMap<Key, CopyBlocks>,
    /// Device block -> the published host key whose copy it holds.
    copy_by_block: ByBlock<Option<Key>>,
    resident_requests: HashSet<String>,
    pending_imports: HashMap<String, usize>,
    /// Host copy-on-write endpoints by destination host block, until the worker ran them.
    retained_copies: BTreeMap<u32, (u32, u32)>,
    import_pages: HashMap<String, usize>,
    import_reservations: HashMap<String, usize>,
    num_reserved_import_pages: usize,
    sized_import: Option<(String, usize)>,
}

impl Residency {
    /// vLLM's `HiSparseCoordinator(...)` checks: the host group precedes the resident groups,
    /// one resident block size equal to the host's. Errors are vLLM's `ValueError`s.
    pub fn new(layout: Layout) -> Result<Self> {
        if layout.host_block_size == 0 {
            return Err(Error::value("host_block_size", "must be > 0"));
        }
        let mut block_size = layout.host_block_size;
        let (mut max_spill_pages, mut transition_watermark) = (0, 0);
        if !layout.resident_groups.is_empty() {
            if layout.resident_block_sizes.len() != layout.resident_groups.len()
                || layout.resident_admission_caps.len() != layout.resident_groups.len()
            {
                return Err(Error::value("resident_groups", "one block size and admission cap per resident group"));
            }
            if layout.host_group > *layout.resident_groups.iter().min().unwrap_or(&0) {
                return Err(Error::Value("HiSparse host group must precede resident groups.".into()));
            }
            let first = layout.resident_block_sizes[0];
            if layout.resident_block_sizes.iter().any(|&s| s != first) {
                return Err(Error::Value("HiSparse resident cache groups must use one block size.".into()));
            }
            if first != layout.host_block_size {
                return Err(Error::Value("HiSparse host and resident block sizes must match.".into()));
            }
            block_size = first;
            max_spill_pages = layout.max_model_len / block_size;
            let hot_cost: usize = layout.hot_groups.iter().map(|&(_, n)| n).sum();
            transition_watermark = hot_cost.max(layout.num_blocks / 10);
        }
        // the per-block books, sized for the device pool up front (bounded: past that they
        // grow on demand); none without resident groups
        let num_blocks = if layout.resident_groups.is_empty() { 0 } else { layout.num_blocks.min(1 << 16) };
        Ok(Residency {
            block_size,
            max_spill_pages,
            transition_watermark,
            changes: vec![HashMap::new(); layout.resident_groups.len()],
            owners: ByBlock::with_blocks(num_blocks),
            copy_by_block: ByBlock::with_blocks(num_blocks),
            hot_required: vec![HashSet::new(); layout.hot_groups.len()],
            layout,
            states: HashMap::new(),
            by_request: HashMap::new(),
            next_state: 0,
            pending: BTreeMap::new(),
            spills_to_send: Vec::new(),
            next_spill_id: 0,
            copies: HashMap::new(),
            resident_requests: HashSet::new(),
            pending_imports: HashMap::new(),
            retained_copies: BTreeMap::new(),
            import_pages: HashMap::new(),
            import_reservations: HashMap::new(),
            num_reserved_import_pages: 0,
            sized_import: None,
        })
    }

    // ---- read-only faces -------------------------------------------------------------------

    /// The page size in tokens (the resident groups' block size).
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The configuration.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// `max_spill_pages`: the spills one step may plan (`max_model_len // block_size`).
    pub fn max_spill_pages(&self) -> usize {
        self.max_spill_pages
    }
    /// `transition_watermark`: below this many free device blocks, requests start reading
    /// from the host.
    pub fn transition_watermark(&self) -> usize {
        self.transition_watermark
    }
    /// Set 0.34's `import_step_tokens` (vLLM's coordinator takes it when it is built, on the
    /// first `get_hisparse_coordinator` call).
    pub fn set_import_step_tokens(&mut self, import_step_tokens: usize) {
        self.layout.import_step_tokens = import_step_tokens;
    }
    /// Set `max_spill_pages` (vLLM's attribute is plain: its tests lower it to bound a
    /// step's spills). Spills already planned stay planned.
    pub fn set_max_spill_pages(&mut self, n: usize) {
        self.max_spill_pages = n;
    }
    /// Set `transition_watermark` (a plain attribute in vLLM, as `max_spill_pages`).
    pub fn set_transition_watermark(&mut self, n: usize) {
        self.transition_watermark = n;
    }
    /// A live request's state (`request_states[request]`).
    pub fn request_state(&self, request: &str) -> Option<&RequestState> {
        self.by_request.get(request).and_then(|s| self.states.get(s))
    }
    /// The requests with a state, and their states.
    pub fn request_states(&self) -> impl Iterator<Item = (&str, &RequestState)> {
        self.by_request.iter().filter_map(|(r, s)| self.states.get(s).map(|st| (&**r, st)))
    }
    /// `pending_spills`, by transfer id.
    pub fn pending_spills(&self) -> &BTreeMap<u64, PendingSpill> {
        &self.pending
    }
    /// `spills_to_send`: the transfers the next offload command carries.
    pub fn spills_to_send(&self) -> &[Transfer] {
        &self.spills_to_send
    }
    /// `copies`: published host key -> device copies.
    pub fn copies(&self) -> &HashMap<Key, CopyBlocks> {
        &self.copies
    }
    /// `hot_required` of hot group `k` (index among the hot groups).
    pub fn hot_required(&self, k: usize) -> &HashSet<String> {
        &self.hot_required[k]
    }
    /// `residency_changes` of resident group `k`.
    pub fn residency_changes(&self, k: usize) -> &HashMap<String, BTreeMap<usize, u32>> {
        &self.changes[k]
    }
    /// 0.34's `reserved_import_pages`.
    pub fn reserved_import_pages(&self) -> usize {
        self.num_reserved_import_pages
    }

    fn state_id(&mut self, request: &str) -> u64 {
        if let Some(&s) = self.by_request.get(request) {
            return s;
        }
        let s = self.next_state;
        self.next_state += 1;
        self.states.insert(s, RequestState::default());
        self.by_request.insert(Arc::from(request), s);
        s
    }

    /// The shared copy of a live request's id (a new one if it has no state).
    fn shared_id(&self, request: &str) -> Arc<str> {
        self.by_request.get_key_value(request).map_or_else(|| Arc::from(request), |(r, _)| Arc::clone(r))
    }

    fn st(&mut self, s: u64) -> &mut RequestState {
        self.states.get_mut(&s).expect("a referenced request state exists")
    }

    /// Drop a state no request and no spill refers to any more.
    fn collect_state(&mut self, s: u64) {
        if !self.by_request.values().any(|&x| x == s) && !self.pending.values().any(|p| p.state == s) {
            self.states.remove(&s);
        }
    }

    // ---- the resident groups' overlay (vLLM's HiSparseResidentManager) ---------------------

    /// `get_resident_page(request, page)` of resident group `k`: the device block the page is
    /// read from, None if it is read from the host (or past the table).
    pub fn get_resident_page(&self, env: &impl Env, k: usize, request: &str, page: usize) -> Option<u32> {
        self.resident_page_in(env.table(self.layout.resident_groups[k], request)?, k, request, page)
    }

    /// [`Residency::get_resident_page`] with resident group `k`'s table of the request in hand.
    fn resident_page_in(&self, table: &[u32], k: usize, request: &str, page: usize) -> Option<u32> {
        let mut b = *table.get(page)?;
        if let Some(c) = self.changes[k].get(request) {
            b = c.get(&page).copied().unwrap_or(b);
        }
        (b != NULL_BLOCK).then_some(b)
    }

    /// `get_residency_row(request, start)` of resident group `k`: the table from `start` with
    /// the overlay applied (host-only pages as the null block).
    pub fn get_residency_row(&self, env: &impl Env, k: usize, request: &str, start: usize) -> Vec<u32> {
        let table = env.table(self.layout.resident_groups[k], request).unwrap_or(&[]);
        overlaid_row(table, self.changes[k].get(request), start)
    }

    /// True if resident group `k`'s residency row of `request` (from page 0) reads a page
    /// from the host (the null block), as `get_residency_row(request, 0).contains(null)`
    /// without building the row.
    fn row_reads_host(&self, env: &impl Env, k: usize, request: &str) -> bool {
        let table = env.table(self.layout.resident_groups[k], request).unwrap_or(&[]);
        let overlay = self.changes[k].get(request).filter(|o| !o.is_empty());
        let Some(o) = overlay else { return table.contains(&NULL_BLOCK) };
        // the table and the overlay's entries within it, merged in one pass
        let mut changes = o.range(..table.len()).peekable();
        table.iter().enumerate().any(|(i, &t)| {
            let b = match changes.peek() {
                Some(&(&p, &b)) if p == i => {
                    changes.next();
                    b
                }
                _ => t,
            };
            b == NULL_BLOCK
        })
    }

    /// `drop_resident_page`: stop reading the page from the device; the block it was read
    /// from.
    pub fn drop_resident_page(&mut self, env: &impl Env, k: usize, request: &str, page: usize) -> Option<u32> {
        let b = self.get_resident_page(env, k, request, page)?;
        self.overlay_mut(k, request).insert(page, NULL_BLOCK);
        Some(b)
    }

    /// Resident group `k`'s overlay of `request`, made if it has none.
    fn overlay_mut(&mut self, k: usize, request: &str) -> &mut BTreeMap<usize, u32> {
        let changes = &mut self.changes[k];
        if !changes.contains_key(request) {
            changes.insert(request.to_string(), BTreeMap::new());
        }
        changes.entry_ref(request).or_default()
    }

    /// `adopt_resident_page`: read a host-only page of the table from `block` instead.
    pub fn adopt_resident_page(&mut self, env: &impl Env, k: usize, request: &str, page: usize, block: u32) -> bool {
        match env.table(self.layout.resident_groups[k], request) {
            Some(t) if page < t.len() => {}
            _ => return false,
        }
        if self.get_resident_page(env, k, request, page).is_some() {
            return false;
        }
        self.overlay_mut(k, request).insert(page, block);
        true
    }

    /// Forget a freed request's overlay (the resident manager's `pop_blocks_for_free`).
    pub fn forget_overlay(&mut self, request: &str) {
        for c in &mut self.changes {
            c.remove(request);
        }
    }

    /// Forget a freed request's overlay in resident group `k` only (`pop_blocks_for_free` of
    /// that group's manager, `residency_changes.pop(request)`).
    pub fn forget_overlay_of(&mut self, k: usize, request: &str) {
        if let Some(c) = self.changes.get_mut(k) {
            c.remove(request);
        }
    }

    /// True while a publication of `request` waits: its live state's, or (a finished request)
    /// the detached one a running spill of it keeps. The manager keeps the request's hashes
    /// for [`Env::publish`] / [`Env::publish_detached`] as long as this holds.
    pub fn has_publication(&self, request: &str) -> bool {
        let live =
            self.by_request.get(request).and_then(|s| self.states.get(s)).is_some_and(|st| st.publication.is_some());
        live || self
            .pending
            .values()
            .any(|p| &*p.request == request && self.states.get(&p.state).is_some_and(|st| st.publication.is_some()))
    }

    // ---- the hot groups (vLLM's HiSparseHotManager) -----------------------------------------

    /// `require_hot(request)` of hot group `k`.
    pub fn require_hot(&mut self, k: usize, request: &str) {
        self.hot_required[k].insert(request.to_string());
    }

    /// `has_hot(request)` of hot group `k`: it holds its whole hot region.
    pub fn has_hot(&self, env: &impl Env, k: usize, request: &str) -> bool {
        let (g, n) = self.layout.hot_groups[k];
        env.table(g, request).map_or(0, |t| t.len()) == n
    }

    /// The hot manager's `pop_blocks_for_free`: the request no longer needs a region.
    pub fn release_hot(&mut self, k: usize, request: &str) {
        self.hot_required[k].remove(request);
    }

    fn require_hot_all(&mut self, request: &str) {
        for k in 0..self.hot_required.len() {
            self.require_hot(k, request);
        }
    }

    fn can_read_from_host(&self, env: &impl Env, request: &str) -> bool {
        !self.layout.hot_groups.is_empty() && (0..self.layout.hot_groups.len()).all(|k| self.has_hot(env, k, request))
    }

    fn fills_admission_window(&self, env: &impl Env, request: &str) -> bool {
        self.layout
            .resident_groups
            .iter()
            .zip(&self.layout.resident_admission_caps)
            .any(|(&g, &cap)| env.table(g, request).map_or(0, |t| t.len()) >= cap)
    }

    fn host_table(&self, env: &impl Env, request: &str) -> Option<Vec<u32>> {
        env.table(self.layout.host_group, request).map(|t| t.to_vec())
    }

    /// The device blocks page `page` of `request` is read from, one per resident group; None
    /// if a group reads it from the host (or has no such page).
    fn resident_blocks(&self, env: &impl Env, request: &str, page: usize) -> Option<CopyBlocks> {
        let n = self.layout.resident_groups.len();
        if n > INLINE_BLOCKS {
            let v: Option<Vec<u32>> = (0..n).map(|k| self.get_resident_page(env, k, request, page)).collect();
            return v.map(|v| CopyBlocks::Boxed(v.into()));
        }
        let mut ids = [0; INLINE_BLOCKS];
        for (k, id) in ids.iter_mut().enumerate().take(n) {
            *id = self.get_resident_page(env, k, request, page)?;
        }
        Some(CopyBlocks::Inline { len: n as u8, ids })
    }

    // ---- admission -------------------------------------------------------------------------

    /// `commit_computed_blocks(request, num_host_pages)`: a prefix hit on host pages the
    /// request now holds; those pages are clean, and their device copies are adopted at the
    /// next [`Residency::update_residency`].
    pub fn commit_computed_blocks(&mut self, env: &impl Env, request: &str, num_host_pages: usize) {
        self.resident_requests.remove(request);
        if self.layout.resident_groups.is_empty() {
            return;
        }
        let held = env.table(self.layout.host_group, request).map_or(0, |t| t.len());
        let n = num_host_pages.min(held);
        if n == 0 {
            return;
        }
        let s = self.state_id(request);
        let st = self.st(s);
        if st.valid_pages.is_empty() {
            // a new request's clean prefix: built in one sorted pass, not page by page
            st.valid_pages = (0..n).collect();
        } else {
            st.valid_pages.extend(0..n);
        }
        st.ready_prefix_pages = st.ready_prefix_pages.max(n);
        st.pages_to_adopt = st.pages_to_adopt.max(n);
        st.copies_recorded_blocks = st.copies_recorded_blocks.max(n);
    }

    // ---- device copies of published host pages --------------------------------------------

    fn drop_copy(&mut self, key: &Key) {
        if let Some(blocks) = self.copies.remove(key) {
            self.forget_copy_blocks(&blocks);
        }
    }

    fn forget_copy_blocks(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if let Some(k) = self.copy_by_block.get_mut(b) {
                *k = None;
            }
        }
    }

    fn record_copy(&mut self, env: &impl Env, request: &str, page: usize, host_block: u32) -> Result<()> {
        if host_block == NULL_BLOCK {
            return Ok(());
        }
        let Some(key) = env.host_ref().block_key(host_block)? else { return Ok(()) };
        let Some(blocks) = self.resident_blocks(env, request, page) else { return Ok(()) };
        // the key's earlier copy is dropped (its blocks forgotten) before the new one is kept
        // (one lookup of the key)
        let old = match self.copies.entry(key) {
            hashbrown::hash_map::Entry::Occupied(mut o) => Some(std::mem::replace(o.get_mut(), blocks.clone())),
            hashbrown::hash_map::Entry::Vacant(v) => {
                v.insert(blocks.clone());
                None
            }
        };
        if let Some(old) = old {
            self.forget_copy_blocks(&old);
        }
        for &b in blocks.iter() {
            *self.copy_by_block.entry(b) = Some(key);
        }
        Ok(())
    }

    fn record_copies(&mut self, env: &impl Env, request: &str, num_computed_tokens: usize) -> Result<()> {
        if self.layout.resident_groups.is_empty() {
            return Ok(());
        }
        let host = match env.table(self.layout.host_group, request) {
            Some(t) if !t.is_empty() => t,
            _ => return Ok(()),
        };
        let s = self.state_id(request);
        let n = (num_computed_tokens / self.layout.host_block_size).min(host.len());
        let from = self.st(s).copies_recorded_blocks;
        for (page, &hb) in host.iter().enumerate().take(n).skip(from) {
            if self.st(s).pending_pages.contains_key(&page) {
                continue;
            }
            self.record_copy(env, request, page, hb)?;
        }
        let st = self.st(s);
        st.copies_recorded_blocks = st.copies_recorded_blocks.max(n);
        Ok(())
    }

    fn adopt_copies(&mut self, env: &mut impl Env, request: &str, s: u64, host_blocks: &[u32]) -> Result<()> {
        if self.copies.is_empty() {
            return Ok(());
        }
        for (page, &hb) in host_blocks.iter().enumerate() {
            if hb == NULL_BLOCK {
                continue;
            }
            let Some(key) = env.host_ref().block_key(hb)? else { continue };
            let Some(blocks) = self.copies.get(&key).cloned() else { continue };
            for (k, b) in blocks.iter().copied().enumerate().take(self.layout.resident_groups.len()) {
                if self.adopt_resident_page(env, k, request, page, b) {
                    env.device().touch(&[b], true)?;
                    let st = self.st(s);
                    st.pinned_clean.insert(page);
                    if page < st.synced_pages {
                        st.stale_pages.insert(page);
                    }
                }
            }
        }
        Ok(())
    }

    // ---- pinning, unpinning and losing pages -----------------------------------------------

    fn unpinnable_blocks(&self, env: &impl Env, request: &str, page: usize) -> Option<Vec<u32>> {
        let mut out = Vec::with_capacity(self.layout.resident_groups.len());
        for (k, &g) in self.layout.resident_groups.iter().enumerate() {
            let table = env.table(g, request).unwrap_or(&[]); // no table: no pages
            if page + ACTIVE_TAIL_PAGES >= table.len() {
                return None;
            }
            out.push(self.resident_page_in(table, k, request, page)?);
        }
        Some(out)
    }

    fn unpin_page(&mut self, env: &mut impl Env, request: &Arc<str>, s: u64, page: usize) -> Result<bool> {
        let st = &self.states[&s];
        if st.pending_pages.contains_key(&page) || !st.valid_pages.contains(&page) {
            return Ok(false);
        }
        let Some(blocks) = self.unpinnable_blocks(env, request, page) else { return Ok(false) };
        for b in blocks {
            self.owners.entry(b).insert(request, page);
            env.device().unpin_blocks(&[b], RESIDENCY_WATCHER)?;
        }
        let st = self.st(s);
        st.pinned_clean.remove(&page);
        st.unpinned_pages.insert(page);
        Ok(true)
    }

    fn page_became_clean(&mut self, env: &mut impl Env, request: &Arc<str>, s: u64, page: usize) -> Result<()> {
        self.st(s).pinned_clean.insert(page);
        if self.can_read_from_host(env, request) {
            self.unpin_page(env, request, s, page)?;
        }
        Ok(())
    }

    /// The device pool handed out `blocks` that the residency had released (its fired reuse
    /// watchers, `RESIDENCY_WATCHER`): their copies are forgotten and every request still
    /// reading them loses the page.
    pub fn on_blocks_reused(&mut self, env: &impl Env, blocks: &[u32]) {
        for &b in blocks {
            if let Some(key) = self.copy_by_block.get(b).copied().flatten() {
                self.drop_copy(&key);
            }
            for (request, page) in self.owners.take(b).0 {
                self.lose_page(env, &request, page);
            }
        }
    }

    fn lose_page(&mut self, env: &impl Env, request: &str, page: usize) {
        self.resident_requests.remove(request);
        let Some(&s) = self.by_request.get(request) else { return };
        for k in 0..self.layout.resident_groups.len() {
            if let Some(b) = self.drop_resident_page(env, k, request, page) {
                if let Some(o) = self.owners.get_mut(b) {
                    o.remove(request, page);
                }
            }
        }
        let st = self.st(s);
        st.unpinned_pages.remove(&page);
        if page < st.synced_pages {
            st.stale_pages.insert(page);
        }
        self.require_hot_all(request);
    }

    /// `update_residency(request)`: adopt pending copies; a request that reads from the host
    /// releases its clean sealed pages (tail first); one that cannot asks for a hot region once
    /// the device pool runs below the watermark or it fills its admission window.
    pub fn update_residency(&mut self, env: &mut impl Env, request: &str) -> Result<()> {
        if self.layout.resident_groups.is_empty() {
            return Ok(());
        }
        let s = self.state_id(request);
        let adopt = self.states[&s].pages_to_adopt;
        if adopt > 0 {
            let host = self.host_table(env, request).unwrap_or_default();
            let n = adopt.min(host.len());
            self.adopt_copies(env, request, s, &host[..n])?;
            self.st(s).pages_to_adopt = 0;
        }
        if !self.can_read_from_host(env, request) {
            if env.device_ref().num_free_blocks() >= self.transition_watermark
                && !self.fills_admission_window(env, request)
            {
                return Ok(());
            }
            self.require_hot_all(request);
            return Ok(());
        }
        // the pages within ACTIVE_TAIL_PAGES of the shortest resident table stay pinned
        // (`unpin_page` refuses them, changing nothing): only the others are tried
        let num_pages =
            self.layout.resident_groups.iter().map(|&g| env.table(g, request).map_or(0, <[u32]>::len)).min();
        let end = num_pages.unwrap_or(0).saturating_sub(ACTIVE_TAIL_PAGES);
        let pages: Vec<usize> = self.states[&s].pinned_clean.range(..end).rev().copied().collect();
        let request = self.shared_id(request);
        for page in pages {
            self.unpin_page(env, &request, s, page)?;
        }
        Ok(())
    }

    // ---- host publication and spills -------------------------------------------------------

    /// `advance_scheduled`: per scheduled `(request, tokens computed once the step ends)`,
    /// plan the write-back of its sealed pages (the last `num_reprefillable_tokens` are not
    /// final) and update its residency.
    pub fn advance_scheduled<S: AsRef<str>>(&mut self, env: &mut impl Env, requests: &[(S, usize)]) -> Result<()> {
        if self.layout.resident_groups.is_empty() {
            return Ok(());
        }
        for (request, n) in requests {
            let request = request.as_ref();
            let n = n.saturating_sub(self.layout.num_reprefillable_tokens);
            self.plan_prefix_materialization(env, request, n)?;
            self.update_residency(env, request)?;
        }
        Ok(())
    }

    /// `plan_prefix_materialization`: plan a spill for every sealed page with no host copy
    /// yet, within the step's spill budget.
    pub fn plan_prefix_materialization(
        &mut self,
        env: &mut impl Env,
        request: &str,
        num_computed_tokens: usize,
    ) -> Result<()> {
        if self.layout.resident_groups.is_empty() {
            return Ok(());
        }
        let hbs = self.layout.host_block_size;
        let num_pages = num_computed_tokens / hbs;
        let importing = cdiv(self.pending_imports.get(request).copied().unwrap_or(0), hbs);
        let s = self.state_id(request);
        let mut budget = self.max_spill_pages.saturating_sub(self.spills_to_send.len());
        let first = self.states[&s].ready_prefix_pages.max(importing);
        if first >= num_pages || budget == 0 {
            return Ok(());
        }
        // the request's id and state are looked up once for all its pages
        let shared = self.shared_id(request);
        for page in first..num_pages {
            if budget == 0 {
                break;
            }
            let st = &self.states[&s];
            if st.pending_pages.contains_key(&page) || st.valid_pages.contains(&page) {
                continue;
            }
            let Some(blocks) = self.resident_blocks(env, request, page) else { continue };
            if self.plan_transfer_of(env, &shared, s, page, blocks, true, false)? {
                budget -= 1;
            }
        }
        Ok(())
    }

    fn plan_page_transfer(
        &mut self,
        env: &mut impl Env,
        request: &str,
        page: usize,
        after_forward: bool,
        restore: bool,
    ) -> Result<bool> {
        let s = self.state_id(request);
        if self.states[&s].pending_pages.contains_key(&page) {
            return Ok(false);
        }
        let Some(blocks) = self.resident_blocks(env, request, page) else { return Ok(false) };
        let shared = self.shared_id(request);
        self.plan_transfer_of(env, &shared, s, page, blocks, after_forward, restore)
    }

    /// [`Residency::plan_page_transfer`] of a page with no spill pending, whose device blocks
    /// (one per resident group) are `blocks`, of the request `request` whose state is `s`:
    /// false, planning nothing, when the request holds no host block for the page.
    #[allow(clippy::too_many_arguments)] // the page's request, state and blocks, looked up once by the callers
    fn plan_transfer_of(
        &mut self,
        env: &mut impl Env,
        request: &Arc<str>,
        s: u64,
        page: usize,
        blocks: CopyBlocks,
        after_forward: bool,
        restore: bool,
    ) -> Result<bool> {
        let Some(&host_block) = env.table(self.layout.host_group, request).and_then(|t| t.get(page)) else {
            return Ok(false);
        };
        if host_block == NULL_BLOCK {
            return Ok(false);
        }
        env.host().touch(&[host_block], true)?;
        // one call for the page's blocks (distinct: one per resident group), in order
        env.device().touch(&blocks, true)?;
        let id = self.next_spill_id;
        self.next_spill_id += 1;
        self.spills_to_send.push(Transfer {
            transfer_id: id,
            host_block_id: host_block,
            resident_block_ids: blocks.to_vec(),
            after_forward,
            restore,
        });
        self.pending.insert(
            id,
            PendingSpill {
                transfer_id: id,
                request: Arc::clone(request),
                page,
                state: s,
                host_block,
                resident_blocks: blocks,
                restore,
                expected_worker_completions: 0,
                worker_completions: 0,
                enqueue_applied: false,
            },
        );
        self.st(s).pending_pages.insert(page, id);
        Ok(true)
    }

    /// True if `publish_when_ready(request, num_computed_tokens)` would leave everything as it
    /// is, given that the host group has cached the request's full blocks of those tokens
    /// already: the request has a state with no publication owed, its clean prefix covers the
    /// tokens' pages (so the publication is settled at once) and their device copies are
    /// recorded (`host_pages`: the host blocks the request holds). A decode step between page
    /// boundaries, once its sealed pages are on the host.
    pub fn publication_settled(&self, request: &str, num_computed_tokens: usize, host_pages: usize) -> bool {
        let Some(st) = self.request_state(request) else { return false };
        let pages = num_computed_tokens / self.layout.host_block_size;
        st.publication.is_none()
            && st.ready_prefix_pages >= pages
            && (self.layout.resident_groups.is_empty()
                || host_pages == 0
                || st.copies_recorded_blocks >= pages.min(host_pages))
    }

    /// `publish_when_ready(request, num_computed_tokens)`: publish the host blocks of the
    /// durable prefix now, the rest as their spills complete.
    pub fn publish_when_ready(&mut self, env: &mut impl Env, request: &str, num_computed_tokens: usize) -> Result<()> {
        let s = self.state_id(request);
        self.st(s).publication = Some(Publication {
            num_computed_tokens,
            num_pages: num_computed_tokens / self.layout.host_block_size,
            detached_blocks: None,
            num_cached_blocks: 0,
        });
        self.publish_if_ready(env, request)
    }

    fn publish_if_ready(&mut self, env: &mut impl Env, request: &str) -> Result<()> {
        let Some(&s) = self.by_request.get(request) else { return Ok(()) };
        let st = &self.states[&s];
        let Some(p) = st.publication.as_ref() else { return Ok(()) };
        let n = p.num_computed_tokens.min(st.ready_prefix_pages * self.layout.host_block_size);
        let done = st.ready_prefix_pages >= p.num_pages;
        env.publish(request, n)?;
        self.record_copies(env, request, n)?;
        if done {
            self.st(s).publication = None;
        }
        Ok(())
    }

    /// `record_pending_host_import`: an external load is filling `num_tokens` of host pages.
    pub fn record_pending_host_import(&mut self, request: &str, num_tokens: usize) {
        self.resident_requests.remove(request);
        self.pending_imports.insert(request.to_string(), num_tokens);
        if let Some((r, pages)) = self.sized_import.take() {
            if r == request {
                self.import_pages.insert(r, pages);
            }
        }
    }

    /// `finish_host_import(request, failed)`.
    pub fn finish_host_import(&mut self, env: &mut impl Env, request: &str, failed: bool) -> Result<()> {
        if let Some(n) = self.pending_imports.remove(request) {
            if !failed {
                self.complete_host_import(env, request, n)?;
            }
        }
        Ok(())
    }

    /// `complete_host_import`: the imported pages are clean; the last one is restored to the
    /// device (a restore transfer) and the prefix published.
    pub fn complete_host_import(
        &mut self,
        env: &mut impl Env,
        request: &str,
        num_computed_tokens: usize,
    ) -> Result<()> {
        if self.layout.resident_groups.is_empty() {
            return Ok(());
        }
        let num_pages = num_computed_tokens / self.block_size;
        let s = self.state_id(request);
        let st = self.st(s);
        st.valid_pages = (0..num_pages).collect();
        st.ready_prefix_pages = num_pages;
        if num_computed_tokens > 0 {
            self.plan_page_transfer(env, request, (num_computed_tokens - 1) / self.block_size, false, true)?;
        }
        self.publish_if_ready(env, request)
    }

    /// 0.34's `size_import`: the full-sequence host pages of an import being admitted.
    pub fn size_import(&mut self, request: &str, num_pages: usize) {
        self.sized_import = Some((request.to_string(), num_pages));
    }

    /// 0.34's `update_import_reservation`: the import now holds `num_held_pages`.
    pub fn update_import_reservation(&mut self, request: &str, num_held_pages: usize) {
        let Some(&pages) = self.import_pages.get(request) else { return };
        self.set_import_reservation(request, pages.saturating_sub(num_held_pages));
        if num_held_pages >= pages {
            self.import_pages.remove(request);
        }
    }

    fn set_import_reservation(&mut self, request: &str, num_pages: usize) {
        let old = self.import_reservations.remove(request).unwrap_or(0);
        self.num_reserved_import_pages = self.num_reserved_import_pages + num_pages - old;
        if num_pages > 0 {
            self.import_reservations.insert(request.to_string(), num_pages);
        }
    }

    // ---- worker-facing views ---------------------------------------------------------------

    /// `build_row_mirrors`: per scheduled `(request, computed, scheduled)`, the row spans to
    /// mirror from the device pages into their host blocks (pages with no device copy or no
    /// host block are skipped, their neighbours kept).
    pub fn build_row_mirrors<S: AsRef<str>>(&self, env: &impl Env, requests: &[(S, usize, usize)]) -> Vec<RowMirror> {
        let mut out = Vec::new();
        for (request, computed, scheduled) in requests {
            self.row_mirror_spans(env, request.as_ref(), *computed, *scheduled, |s| {
                out.push(s.mirror(self.block_size));
            });
        }
        out
    }

    /// The spans of [`Residency::build_row_mirrors`] for one scheduled row, in order, handed
    /// to `f` without building their start lists: the request's host and resident tables
    /// and overlays are looked up once, not per page.
    pub fn row_mirror_spans(
        &self,
        env: &impl Env,
        request: &str,
        computed: usize,
        scheduled: usize,
        mut f: impl FnMut(MirrorSpan),
    ) {
        let n = self.layout.resident_groups.len();
        if n == 0 {
            return;
        }
        let Some(host) = env.table(self.layout.host_group, request) else { return };
        if n > INLINE_BLOCKS {
            // many resident groups: page by page through the general lookup
            if self.layout.resident_groups.iter().any(|&g| env.table(g, request).is_none()) {
                return;
            }
            self.spans_of(host, computed, scheduled, |page| self.resident_blocks(env, request, page), f);
            return;
        }
        let mut tables: [&[u32]; INLINE_BLOCKS] = [&[]; INLINE_BLOCKS];
        let mut overlays: [Option<&BTreeMap<usize, u32>>; INLINE_BLOCKS] = [None; INLINE_BLOCKS];
        for (k, &g) in self.layout.resident_groups.iter().enumerate() {
            let Some(t) = env.table(g, request) else { return };
            tables[k] = t;
        }
        // overlays are read only once a page is found in every table (the common empty
        // scheduled row reads none)
        let mut overlays_read = false;
        self.spans_of(
            host,
            computed,
            scheduled,
            |page| {
                if !overlays_read {
                    for (k, o) in overlays.iter_mut().enumerate().take(n) {
                        *o = self.changes[k].get(request);
                    }
                    overlays_read = true;
                }
                let mut ids = [0; INLINE_BLOCKS];
                for k in 0..n {
                    let mut b = *tables[k].get(page)?;
                    if let Some(c) = overlays[k] {
                        b = c.get(&page).copied().unwrap_or(b);
                    }
                    if b == NULL_BLOCK {
                        return None;
                    }
                    ids[k] = b;
                }
                Some(CopyBlocks::Inline { len: n as u8, ids })
            },
            &mut f,
        );
    }

    /// Walk the pages of rows `computed..computed + scheduled`: each page whose resident
    /// blocks `blocks_of` finds (None: a page read from the host, skipped) and whose host
    /// block is set gives one span.
    fn spans_of(
        &self,
        host: &[u32],
        computed: usize,
        scheduled: usize,
        mut blocks_of: impl FnMut(usize) -> Option<CopyBlocks>,
        mut f: impl FnMut(MirrorSpan),
    ) {
        let bs = self.block_size;
        let (mut pos, end) = (computed, computed + scheduled);
        while pos < end {
            let (page, off) = (pos / bs, pos % bs);
            let rows = (bs - off).min(end - pos);
            pos += rows;
            let Some(blocks) = blocks_of(page) else { continue };
            let Some(&hb) = host.get(page) else { continue };
            if hb == NULL_BLOCK {
                continue;
            }
            f(MirrorSpan { blocks, offset: off, destination_start: hb as usize * bs + off, num_rows: rows });
        }
    }

    /// `all_context_pages_resident`: every scheduled request reads only device pages.
    pub fn all_context_pages_resident<S: AsRef<str>>(
        &mut self,
        env: &impl Env,
        requests: &[(S, usize, usize)],
    ) -> bool {
        let Some(&first) = self.layout.resident_groups.first() else { return false };
        for (request, computed, scheduled) in requests {
            let request = request.as_ref();
            let pages = cdiv(computed + scheduled, self.block_size);
            if env.table(first, request).map_or(0, |t| t.len()) < pages {
                return false;
            }
            if self.resident_requests.contains(request) {
                continue;
            }
            if (0..self.layout.resident_groups.len()).any(|k| self.row_reads_host(env, k, request)) {
                return false;
            }
            self.resident_requests.insert(request.to_string());
        }
        true
    }

    /// `take_residency_updates`: per request, its stale pages and the pages appended since the
    /// last update (requests with nothing new are left out).
    pub fn take_residency_updates<S: AsRef<str>>(
        &mut self,
        env: &impl Env,
        requests: &[S],
    ) -> Vec<(String, ResidencyUpdate)> {
        let mut out = Vec::new();
        let Some(&first) = self.layout.resident_groups.first() else { return out };
        for request in requests {
            let request = request.as_ref();
            let s = self.state_id(request);
            let num_pages = env.table(first, request).map_or(0, |t| t.len());
            let st = &self.states[&s];
            let start = st.synced_pages;
            if st.stale_pages.is_empty() && start >= num_pages {
                continue;
            }
            let stale: Vec<usize> = st.stale_pages.iter().copied().collect();
            let block_ids = (0..self.layout.resident_groups.len())
                .map(|k| {
                    let mut ids: Vec<u32> = stale
                        .iter()
                        .map(|&p| self.get_resident_page(env, k, request, p).unwrap_or(NULL_BLOCK))
                        .collect();
                    ids.extend(self.get_residency_row(env, k, request, start));
                    ids
                })
                .collect();
            let pages = stale.iter().copied().chain(start..num_pages).collect();
            let st = self.st(s);
            st.stale_pages.clear();
            st.synced_pages = num_pages;
            out.push((request.to_string(), ResidencyUpdate { pages, block_ids }));
        }
        out
    }

    /// `build_offload_command`: the planned transfers, drained (None without resident groups).
    pub fn take_offload_command(&mut self) -> Option<Vec<Transfer>> {
        if self.layout.resident_groups.is_empty() {
            return None;
        }
        Some(std::mem::take(&mut self.spills_to_send))
    }

    /// `has_pending_reclamation`: a running spill frees a host or device block on completion.
    pub fn has_pending_reclamation(&self, env: &impl Env) -> bool {
        self.pending.values().any(|p| {
            env.host_ref().ref_of(p.host_block) == 1
                || (self.by_request.contains_key(&*p.request) && self.can_read_from_host(env, &p.request))
        })
    }

    /// `has_pending_work`: transfers to send, spills running or host copies retained.
    pub fn has_pending_work(&self) -> bool {
        !self.spills_to_send.is_empty() || !self.pending.is_empty() || !self.retained_copies.is_empty()
    }

    /// `take_host_block_copies`: retain the host copy-on-write pairs `(source, copy)` handed
    /// to the worker until it reports them done.
    pub fn retain_host_copies(&mut self, pairs: &[(u32, u32)]) {
        for &(src, dst) in pairs {
            self.retained_copies.insert(dst, (src, dst));
        }
    }

    /// `release_completed_host_copies`: free both ends of the copies the worker ran (unknown
    /// and repeated destination ids ignored). Errors: the host pool's (an endpoint freed
    /// elsewhere meanwhile), with nothing released.
    pub fn release_completed_host_copies(&mut self, env: &mut impl Env, dst_block_ids: &[u32]) -> Result<()> {
        let mut blocks = Vec::new();
        let mut released = Vec::new();
        for d in dst_block_ids {
            if released.contains(d) {
                continue;
            }
            if let Some(&(s, d)) = self.retained_copies.get(d) {
                blocks.push(s);
                blocks.push(d);
                released.push(d);
            }
        }
        if blocks.is_empty() {
            return Ok(());
        }
        blocks.reverse();
        env.host().free_blocks(&blocks, true)?;
        for d in &released {
            self.retained_copies.remove(d);
        }
        Ok(())
    }

    /// `update_spills(enqueued, completed)`: per transfer id, how many workers enqueued it
    /// (the first report counts) and how many more completed it. A spill every worker
    /// completed drops its device references, then its page is clean (or, restored, stays
    /// as it was), its host reference is dropped and the clean prefix is published.
    pub fn update_spills(
        &mut self,
        env: &mut impl Env,
        enqueued: &[(u64, usize)],
        completed: &[(u64, usize)],
    ) -> Result<()> {
        for &(id, n) in enqueued {
            if let Some(p) = self.pending.get_mut(&id) {
                if p.expected_worker_completions == 0 {
                    p.expected_worker_completions = n;
                }
            }
        }
        for &(id, n) in completed {
            if let Some(p) = self.pending.get_mut(&id) {
                p.worker_completions += n;
            }
        }
        let done = |p: &PendingSpill| {
            p.expected_worker_completions > 0 && p.worker_completions >= p.expected_worker_completions
        };
        let apply: Vec<u64> =
            self.pending.values().filter(|p| !p.enqueue_applied && done(p)).map(|p| p.transfer_id).collect();
        for id in apply {
            let Some(p) = self.pending.get_mut(&id) else { continue };
            // one call for the page's blocks (distinct: one per resident group), in order
            env.device().free_blocks(&p.resident_blocks, true)?;
            p.enqueue_applied = true;
        }
        let completed: Vec<u64> =
            self.pending.values().filter(|p| p.enqueue_applied && done(p)).map(|p| p.transfer_id).collect();
        let mut requests: Vec<Arc<str>> = Vec::new();
        for id in completed {
            let Some(p) = self.pending.remove(&id) else { continue };
            // the request's live state (nothing below frees or admits a request)
            let live = self.by_request.get(&*p.request) == Some(&p.state);
            let st = self.st(p.state);
            st.pending_pages.remove(&p.page);
            if live {
                // a restored page stays as it was; a written one is clean now
                let clean = !p.restore || st.valid_pages.contains(&p.page);
                if !p.restore {
                    st.valid_pages.insert(p.page);
                }
                if clean {
                    self.page_became_clean(env, &p.request, p.state, p.page)?;
                    if p.restore {
                        self.record_copy(env, &p.request, p.page, p.host_block)?;
                    }
                }
                if !requests.iter().any(|r| Arc::ptr_eq(r, &p.request) || *r == p.request) {
                    requests.push(Arc::clone(&p.request));
                }
            } else if self.states[&p.state].publication.is_some() {
                if !p.restore {
                    self.st(p.state).valid_pages.insert(p.page);
                }
                self.publish_detached(env, &p.request, p.state)?;
            }
            env.host().free_blocks(&[p.host_block], true)?;
            if !live {
                self.collect_state(p.state); // a live request's state stays
            }
        }
        for request in requests {
            let Some(&s) = self.by_request.get(&*request) else { continue };
            let st = self.st(s);
            while st.valid_pages.contains(&st.ready_prefix_pages) {
                st.ready_prefix_pages += 1;
            }
            self.publish_if_ready(env, &request)?;
        }
        Ok(())
    }

    fn publish_detached(&mut self, env: &mut impl Env, request: &str, s: u64) -> Result<()> {
        let st = &self.states[&s];
        let Some(p) = st.publication.as_ref() else { return Ok(()) };
        if !st.pending_pages.is_empty() {
            return Ok(());
        }
        let Some(blocks) = p.detached_blocks.clone() else { return Ok(()) };
        let (num_cached, num_pages) = (p.num_cached_blocks, p.num_pages);
        let st = self.st(s);
        while st.valid_pages.contains(&st.ready_prefix_pages) {
            st.ready_prefix_pages += 1;
        }
        let num_full = st.ready_prefix_pages.min(num_pages);
        env.publish_detached(request, &blocks, num_cached, num_full)?;
        let rev: Vec<u32> = blocks.iter().rev().copied().collect();
        env.host().free_blocks(&rev, true)?;
        self.st(s).publication = None;
        Ok(())
    }

    /// `free(request)`: detach the request. A finished request with spills still running
    /// keeps its host blocks (touched) until they complete and publish; its clean device pages
    /// are released (unpinned), still readable copies, tail first.
    pub fn free(&mut self, env: &mut impl Env, request: &str, finished: bool) -> Result<()> {
        self.resident_requests.remove(request);
        self.pending_imports.remove(request);
        self.import_pages.remove(request);
        self.set_import_reservation(request, 0);
        let Some(s) = self.by_request.remove(request) else { return Ok(()) };
        let st = &self.states[&s];
        let detach = st.publication.is_some() && finished && !st.pending_pages.is_empty();
        if detach {
            let num_pages = st.publication.as_ref().map_or(0, |p| p.num_pages);
            let host = self.host_table(env, request).unwrap_or_default();
            let blocks = host[..num_pages.min(host.len())].to_vec();
            let num_cached = env.num_cached(self.layout.host_group, request);
            env.host().touch(&blocks, true)?;
            if let Some(p) = self.st(s).publication.as_mut() {
                p.detached_blocks = Some(blocks);
                p.num_cached_blocks = num_cached;
            }
        } else {
            self.st(s).publication = None;
        }
        // per resident group, tail first: an unpinned page stops naming the request as a
        // reader of its block, a clean sealed page is released (unpinned, still readable);
        // either way the page is dropped from the overlay. One pass over the row decides, then
        // the releases go to the pool in one call (the same order) and the overlay is written
        // once.
        let (mut unpin, mut dropped, mut disowned) = (Vec::new(), Vec::new(), Vec::new());
        for k in 0..self.layout.resident_groups.len() {
            let row = self.get_residency_row(env, k, request, 0);
            let st = &self.states[&s];
            for (page, &b) in row.iter().enumerate().rev() {
                if b == NULL_BLOCK {
                    continue;
                }
                // every page below the clean prefix is clean (`ready_prefix_pages` only ever
                // covers pages of `valid_pages`)
                let clean = page < st.ready_prefix_pages || st.valid_pages.contains(&page);
                if st.unpinned_pages.contains(&page) {
                    disowned.push((b, page));
                } else if clean && !st.pending_pages.contains_key(&page) {
                    unpin.push(b);
                } else {
                    continue;
                }
                dropped.push(page);
            }
            for &(b, page) in &disowned {
                if let Some(o) = self.owners.get_mut(b) {
                    o.remove(request, page);
                }
            }
            if !unpin.is_empty() {
                env.device().unpin_blocks(&unpin, RESIDENCY_WATCHER)?;
            }
            if !dropped.is_empty() {
                // the pages came tail first: built in one sorted pass, then merged
                let mut drops: BTreeMap<usize, u32> = dropped.iter().rev().map(|&p| (p, NULL_BLOCK)).collect();
                self.overlay_mut(k, request).append(&mut drops);
            }
            unpin.clear();
            dropped.clear();
            disowned.clear();
        }
        self.collect_state(s);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
