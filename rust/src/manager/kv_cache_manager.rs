//! vLLM's `KVCacheManager` (spec §5): the scheduler-facing calls over the coordinator, with
//! every input checked before anything changes.

use crate::error::{Error, Result};
use crate::hashing::source::HashSource;
use crate::manager::coordinator::{CoordinatedHit, Coordinator};
use crate::manager::group_state::{cdiv, ReqInfo};
use crate::manager::hit_verify::{BlockContent, HitVerifier, VerifyCtx};
use crate::manager::retention::RetentionState;
use crate::manager::spec::{Caller, Kind, MambaMode, ManagerConfig};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};

/// No hit blocks for each of up to this many groups: what `allocate_slots` passes its groups
/// when the caller adopts none (more groups than this get a vector made per call).
static NO_BLOCKS: [&[u32]; 16] = [&[]; 16];

/// The hit blocks passed for each of `n` groups (`new_computed`), or none for each, as slices.
fn hit_lists(new_computed: Option<&[Vec<u32>]>, n: usize) -> std::borrow::Cow<'_, [&[u32]]> {
    use std::borrow::Cow;
    match new_computed {
        Some(nc) => Cow::Owned(nc.iter().map(|g| g.as_slice()).collect()),
        None if n <= NO_BLOCKS.len() => Cow::Borrowed(&NO_BLOCKS[..n]),
        None => Cow::Owned(vec![&[] as &[u32]; n]),
    }
}

/// One flag per KV cache group, kept inline for up to 64 groups.
enum GroupFlags {
    Inline(u64),
    Spilled(Vec<bool>),
}

impl GroupFlags {
    fn of(flags: impl ExactSizeIterator<Item = bool>) -> Self {
        if flags.len() <= 64 {
            GroupFlags::Inline(flags.enumerate().fold(0, |bits, (i, f)| bits | (f as u64) << i))
        } else {
            GroupFlags::Spilled(flags.collect())
        }
    }

    fn get(&self, i: usize) -> bool {
        match self {
            GroupFlags::Inline(bits) => i < 64 && bits >> i & 1 == 1,
            GroupFlags::Spilled(v) => v.get(i).copied().unwrap_or(false),
        }
    }
}

/// What `allocate_slots` reads from the request besides its hashes.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestView<'a> {
    pub request_id: &'a str,
    pub num_computed_tokens: usize,
    pub num_tokens: usize,
    pub num_prompt_tokens: usize,
    pub num_in_flight_tokens: usize,
    pub shared_prefix_boundary: usize,
    /// `request.status in (WAITING, PREEMPTED)`.
    pub waiting_or_preempted: bool,
    /// Caller's handle for the request's KV events.
    pub event_tag: u64,
    /// With verify on hit: the request's tokens and extra keys of the blocks this call may
    /// cache (required then; see [`KVCacheManager::enable_hit_verification`]).
    pub content: Option<&'a BlockContent>,
}

impl<'a> RequestView<'a> {
    fn info(&self) -> ReqInfo<'a> {
        ReqInfo {
            request_id: self.request_id,
            num_prompt_tokens: self.num_prompt_tokens,
            num_computed_tokens: self.num_computed_tokens,
            num_tokens: self.num_tokens,
            shared_prefix_boundary: self.shared_prefix_boundary,
            event_tag: self.event_tag,
        }
    }
}

/// `allocate_slots` arguments (vLLM's names).
#[derive(Clone, Copy, Debug, Default)]
pub struct AllocArgs<'a> {
    pub num_new_tokens: usize,
    pub num_new_computed_tokens: usize,
    /// The hit blocks, one list per group; `None` when the caller passed none or the
    /// manager's shared empty result (vLLM tells that one apart by identity).
    pub new_computed: Option<&'a [Vec<u32>]>,
    pub num_lookahead_tokens: usize,
    pub num_external_computed_tokens: usize,
    pub delay_cache_blocks: bool,
    pub num_encoder_tokens: usize,
    pub full_sequence_must_fit: bool,
    pub reserved_blocks: usize,
    pub has_scheduled_reqs: bool,
    pub skip_zeroing_group_ids: &'a [u32],
    /// The hit blocks' generations when `get_computed_blocks` found them (aligned with
    /// `new_computed`); a block whose generation moved since was evicted and handed out
    /// again: the call fails with [`Error::StaleHit`], changing nothing.
    pub new_computed_generations: Option<&'a [Vec<u32>]>,
}

/// The KV cache manager.
#[derive(Clone, Debug)]
pub struct KVCacheManager {
    pub coord: Coordinator,
    pub max_model_len: usize,
    pub enable_caching: bool,
    pub watermark_blocks: usize,
    /// Whose API the manager serves.
    pub caller: Caller,
    /// Every group is full attention at the hash block size and caches with the manager:
    /// [`KVCacheManager::allocate_is_noop_at`] then reads only the request's tables.
    pub plain_full_attention: bool,
    /// Request retention priorities and pinned prefixes (kvblock's own API).
    pub retention: RetentionState,
    /// Verify on hit (kvblock's own API; None: off, vLLM's behaviour).
    pub verify: Option<HitVerifier>,
}

/// The one thing a running request's `allocate_slots` call at a block boundary does (see
/// [`KVCacheManager::boundary_step_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoundaryStep {
    /// Append this many new blocks (over all groups) to the request's tables.
    Grow(usize),
    /// Cache the request's newly full blocks up to this many tokens.
    Cache(usize),
}

/// What [`KVCacheManager::check_alloc`] leaves for later: an error vLLM raises only after its
/// capacity check (None returned first if the blocks do not fit), and whether kvblock must
/// then undo the empty tables and checkpoints the count made (`undo`: vLLM itself is past
/// comparing by then) rather than keep them as vLLM does.
struct Deferred {
    err: Option<Error>,
    undo: bool,
}

impl KVCacheManager {
    /// True for vLLM's callers ([`Caller::Vllm`]): errors are raised as vLLM's own (an
    /// `IndexError` past a request's hashes, an `AttributeError` for a missing request
    /// attribute) and arguments are read as vLLM's method bodies read them.
    #[inline(always)]
    pub fn vllm_caller(&self) -> bool {
        self.caller == Caller::Vllm
    }

    /// A manager for `cfg` (checked as vLLM's constructors check it).
    pub fn new(cfg: &ManagerConfig) -> Result<Self> {
        let coord = Coordinator::new(cfg)?;
        let plain_full_attention = coord.managers.iter().all(|m| {
            matches!(m.cfg.spec.kind, Kind::FullAttention)
                && m.cfg.block_size == coord.hash_block_size
                && m.cfg.enable_caching == cfg.enable_caching
                && m.cfg.spec.prefix_cacheable
        });
        Ok(KVCacheManager {
            coord,
            max_model_len: cfg.max_model_len,
            enable_caching: cfg.enable_caching,
            watermark_blocks: cfg.watermark_blocks,
            caller: cfg.caller,
            plain_full_attention,
            retention: RetentionState::default(),
            verify: None,
        })
    }

    /// Turn verify on hit on ([`crate::manager::hit_verify`]): from now on every block the
    /// manager caches keeps its exact content, and every hit is checked against the request.
    /// Only before any request is known; every prefix-cacheable group must be full attention
    /// (plain or R-SWA) with the hash block size as its block size, whose hits run from block 0
    /// (sliding-window, chunked-local and Mamba hits skip the blocks their parent chain would
    /// be verified through). A no-op with caching off.
    pub fn enable_hit_verification(&mut self, num_blocks: usize) -> Result<()> {
        if !self.coord.request_ids().is_empty() {
            return Err(Error::State("verify_hits: turn it on before any request is admitted".into()));
        }
        let h = self.coord.hash_block_size;
        for (i, m) in self.coord.managers.iter().enumerate() {
            if !m.cfg.spec.prefix_cacheable || m.cfg.spec.kind == Kind::CrossAttention {
                continue;
            }
            if matches!(m.cfg.spec.kind, Kind::CircularBuffer) {
                continue;
            }
            if !m.cfg.spec.kind.is_full_attention() {
                return Err(Error::value(
                    "verify_hits",
                    format!(
                        "kv_cache_groups[{i}] is not full attention: only full-attention hits run from block 0, \
                         where each block's parent can be verified"
                    ),
                ));
            }
            if m.cfg.block_size != h {
                return Err(Error::value(
                    "verify_hits",
                    format!(
                        "kv_cache_groups[{i}] has {}-token blocks: verified groups need the hash block size ({h})",
                        m.cfg.block_size
                    ),
                ));
            }
        }
        if self.enable_caching {
            self.verify = Some(HitVerifier::new(num_blocks, h)?);
        }
        Ok(())
    }

    /// Hits refused by verify on hit so far (0 when it is off).
    pub fn hit_verification_failures(&self) -> u64 {
        self.verify.as_ref().map_or(0, |v| v.failures())
    }

    /// The verification of a lookup with the request's `content` (None: verify on hit is
    /// off; an error when it is on and no content was given).
    fn verify_ctx<'a>(&'a self, content: Option<&'a BlockContent>, count: bool) -> Result<Option<VerifyCtx<'a>>> {
        match (&self.verify, content) {
            (None, _) => Ok(None),
            (Some(store), Some(content)) => Ok(Some(VerifyCtx { store, content, count })),
            (Some(_), None) => Err(Error::Value("verify_hits: the lookup needs the request's tokens".into())),
        }
    }

    /// Cache the request's blocks (as [`Coordinator::cache_blocks`]), then record those newly
    /// cached when verify on hit is on.
    fn cache_and_record(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        req: &RequestView<'_>,
        hashes: &dyn HashSource,
        num_computed_tokens: usize,
    ) -> Result<()> {
        let Some(verify) = self.verify.as_mut() else {
            return self.coord.cache_blocks(pool, slot, &req.info(), hashes, num_computed_tokens);
        };
        let before: Vec<usize> =
            self.coord.managers.iter().map(|m| m.req(slot).and_then(|r| r.num_cached).unwrap_or(0)).collect();
        self.coord.cache_blocks(pool, slot, &req.info(), hashes, num_computed_tokens)?;
        let Some(content) = req.content else { return Ok(()) };
        for (m, lo) in self.coord.managers.iter().zip(before) {
            if !(m.cfg.enable_caching && m.cfg.spec.prefix_cacheable && m.cfg.spec.kind.is_full_attention()) {
                continue;
            }
            if let Some(r) = m.req(slot) {
                let hi = r.num_cached.unwrap_or(0);
                if hi > lo {
                    verify.record(pool, &r.blocks, lo, hi, content);
                }
            }
        }
        Ok(())
    }

    /// `get_computed_blocks` without the request checks the binding makes: the hit for a
    /// request that reads the prefix cache (`read_cache`), capped at `max_cache_hit_length`
    /// (default `num_tokens - 1`: the last token is always recomputed). With verify on hit,
    /// `content` (the request's blocks from block 0) is required and every block found is
    /// verified against it; `count` adds refusals to [`KVCacheManager::hit_verification_failures`]
    /// (false for `probe`, which changes nothing).
    #[allow(clippy::too_many_arguments)] // vLLM's arguments, plus the request's content
    pub fn get_computed_blocks(
        &self,
        pool: &BlockPool,
        read_cache: bool,
        num_tokens: usize,
        hashes: &dyn HashSource,
        max_cache_hit_length: Option<usize>,
        content: Option<&BlockContent>,
        count: bool,
    ) -> Result<CoordinatedHit> {
        let n = self.coord.num_groups();
        if !(self.enable_caching && read_cache) {
            return Ok((vec![Vec::new(); n], 0, 0));
        }
        let verify = self.verify_ctx(content, count)?;
        let max_len = max_cache_hit_length.unwrap_or(num_tokens.saturating_sub(1));
        let (blocks, hit, uncached) = self.coord.find_longest_cache_hit(pool, hashes, max_len, verify)?;
        let boundary = if uncached > 0 { hit + uncached } else { 0 };
        Ok((blocks, hit, boundary))
    }

    /// Check an `allocate_slots` call's inputs against the pool, changing nothing. `Err`: an
    /// error raised at once. `Ok(Some(e))`: an assertion vLLM makes only once its capacity
    /// check has passed (adopting computed tokens into a request that holds blocks), raised
    /// by the caller at that point, so that a call vLLM answers with None gets None. `known`:
    /// the request's slot, as for [`KVCacheManager::allocate_slots_in`].
    fn check_alloc(
        &self,
        pool: &BlockPool,
        known: Option<usize>,
        req: &RequestView<'_>,
        a: &AllocArgs<'_>,
    ) -> Result<Deferred> {
        if self.verify.is_some() && req.content.is_none() && !a.delay_cache_blocks {
            return Err(Error::Value("verify_hits: allocate_slots needs the request's tokens".into()));
        }
        if a.num_new_tokens == 0 && a.num_external_computed_tokens == 0 && a.num_new_computed_tokens == 0 {
            return Err(Error::Value(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt".into(),
            ));
        }
        if self.caller.is_kvblock() && req.num_tokens > self.max_model_len {
            return Err(Error::value(
                "request",
                format!("{} tokens exceed max_model_len {}", req.num_tokens, self.max_model_len),
            ));
        }
        if let Some(nc) = a.new_computed {
            if nc.len() != self.coord.num_groups() {
                return Err(Error::value(
                    "new_computed_blocks",
                    format!("has {} groups, the manager {}", nc.len(), self.coord.num_groups()),
                ));
            }
            for (i, g) in nc.iter().enumerate() {
                let pool = self.coord.pool_of(i, pool);
                pool.check_ids(g)?;
                for &b in g {
                    if b != NULL_BLOCK && pool.ref_of(b) == 0 && !pool.is_free(b) {
                        return Err(Error::State(format!("hit block {b} has ref_cnt 0 but is not in the free queue")));
                    }
                }
            }
            if let Some(gens) = a.new_computed_generations {
                for (i, (g, gg)) in nc.iter().zip(gens).enumerate() {
                    let pool = self.coord.pool_of(i, pool);
                    for (j, (&b, &gen)) in g.iter().zip(gg).enumerate() {
                        if b != NULL_BLOCK && pool.generation_of(b) != gen {
                            return Err(Error::StaleHit(format!(
                                "new_computed_blocks: hit block {b} (kv_cache_groups[{i}], position {j}) was evicted and \
                                 reused after get_computed_blocks returned it; look the request up again"
                            )));
                        }
                    }
                }
            }
        }
        let n = self.coord.num_groups() as u32;
        if let Some(&g) = a.skip_zeroing_group_ids.iter().find(|&&g| g >= n) {
            return Err(Error::value("skip_zeroing_group_ids", format!("{g} is not a group index")));
        }
        // vLLM asserts that a running request brings no hit blocks while counting blocks
        // (before its capacity checks), and, once they passed, that only a request holding
        // no blocks adopts computed tokens and that a partial hit's tail sits where it looks
        // for it: all checked here, before anything changes
        let slot = known;
        let running = slot.is_some_and(|s| self.coord.is_running(s));
        let holds = slot.is_some_and(|s| {
            self.coord.managers.iter().any(|m| {
                !matches!(m.cfg.spec.kind, Kind::CircularBuffer | Kind::CrossAttention)
                    && m.req(s).is_some_and(|r| r.present && !r.blocks.is_empty())
            })
        });
        let has_hits = a.new_computed.is_some_and(|nc| nc.iter().any(|g| !g.is_empty()));
        // vLLM's block count asserts it group by group, in a group counting with the base
        // rule (not Mamba "align", not circular buffers) that tracks the request as running
        // (its own `num_cached_block`: a Mamba group tracks a request from its first
        // allocation, a full-attention group only once it cached or adopted blocks); other
        // hits meet the coordinator's assertion after the capacity check
        let counted_hits = slot.is_some_and(|s| {
            a.new_computed.is_some_and(|nc| {
                nc.iter().zip(&self.coord.managers).any(|(g, m)| {
                    !g.is_empty()
                        && !matches!(m.cfg.spec.kind, Kind::CircularBuffer | Kind::Mamba { mode: MambaMode::Align, .. })
                        && m.req(s).is_some_and(|r| r.num_cached.is_some())
                })
            })
        });
        // built only when raised or deferred (a decode step's call never needs it)
        let running_hits = || {
            Error::Assertion(format!(
                "request {:?} already holds blocks and cannot adopt new computed blocks",
                req.request_id
            ))
        };
        if has_hits && (counted_hits || (self.caller.is_kvblock() && (running || holds))) {
            return Err(running_hits());
        }
        if self.caller.is_kvblock() {
            for (i, m) in self.coord.managers.iter().enumerate() {
                let len = a.new_computed.map_or(0, |nc| nc[i].len());
                let bs = m.cfg.block_size;
                let cacheable = m.cfg.spec.prefix_cacheable && m.cfg.spec.kind != Kind::CrossAttention;
                let want = if cacheable { a.num_new_computed_tokens.div_ceil(bs) } else { 0 };
                // hits land on block boundaries unless the hybrid lookup is fine-grained
                let aligned =
                    self.coord.enable_partial_hash_hits || !cacheable || a.num_new_computed_tokens.is_multiple_of(bs);
                let ok = aligned && if m.cfg.spec.kind.is_mamba() { len <= want } else { len == want };
                if !ok {
                    return Err(Error::value(
                        "num_new_computed_tokens",
                        format!(
                            "{} must equal the hit blocks' tokens ({len} blocks of {} in kv_cache_groups[{i}])",
                            a.num_new_computed_tokens, m.cfg.block_size
                        ),
                    ));
                }
            }
        }
        let adopts = a.new_computed.is_some() || a.num_external_computed_tokens > 0;
        let mut deferred = None;
        let mut undo = false;
        if has_hits && running {
            deferred = Some(running_hits());
        } else if adopts && !running && holds {
            let e = Error::Assertion(format!(
                "request {:?} already holds blocks and cannot adopt computed tokens",
                req.request_id
            ));
            if self.caller.is_kvblock() {
                // kvblock's own API raises every refusal before anything changes
                return Err(e);
            }
            deferred = Some(e);
        }
        if adopts && !running {
            let nc = hit_lists(a.new_computed, self.coord.num_groups());
            let local = req.num_computed_tokens.saturating_add(a.num_new_computed_tokens);
            if deferred.is_none() {
                if let Err(e) = self.coord.check_adoption(slot, &nc, local, a.num_external_computed_tokens) {
                    if self.caller.is_kvblock() {
                        return Err(e);
                    }
                    // vLLM meets this assertion only after adopting the hit and taking new
                    // blocks (its state is then beyond comparing): kvblock changes nothing
                    deferred = Some(e);
                    undo = true;
                }
            }
        }
        if self.caller.is_kvblock() {
            // vLLM caps the computed tokens at max_model_len for its capacity check but
            // adopts external tokens uncapped (raising from its pool after taking the hits'
            // references when they do not fit): no request computes past max_model_len
            let computed = req
                .num_computed_tokens
                .saturating_add(a.num_new_computed_tokens)
                .saturating_add(a.num_external_computed_tokens);
            if computed > self.max_model_len {
                let field = if a.num_external_computed_tokens > 0 {
                    "num_external_computed_tokens"
                } else if a.num_new_computed_tokens > 0 {
                    "num_new_computed_tokens"
                } else {
                    "request.num_computed_tokens"
                };
                return Err(Error::value(
                    field,
                    format!(
                        "{} computed + {} hit + {} external tokens exceed max_model_len {}",
                        req.num_computed_tokens,
                        a.num_new_computed_tokens,
                        a.num_external_computed_tokens,
                        self.max_model_len
                    ),
                ));
            }
        }
        if self.caller.is_kvblock() {
            if let Some(e) = deferred {
                return Err(e);
            }
        }
        Ok(Deferred { err: deferred, undo })
    }

    /// `allocate_slots` (spec §5.3): `Ok(None)` when the pool cannot hold the allocation
    /// (only the out-of-window frees vLLM also makes have happened), else the newly
    /// allocated blocks per group. `hashes` are read only if blocks are cached; the caller
    /// has checked the range [`KVCacheManager::cache_read_range`] gives.
    pub fn allocate_slots(
        &mut self,
        pool: &mut BlockPool,
        req: &RequestView<'_>,
        hashes: &dyn HashSource,
        a: &AllocArgs<'_>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let known = self.coord.slot(req.request_id);
        self.allocate_slots_in(pool, known, req, hashes, a)
    }

    /// [`KVCacheManager::allocate_slots`] for a caller that knows the request's slot:
    /// `known` is `Coordinator::slot(req.request_id)` (None for a request the manager does
    /// not hold), which saves looking the id up again.
    pub fn allocate_slots_in(
        &mut self,
        pool: &mut BlockPool,
        known: Option<usize>,
        req: &RequestView<'_>,
        hashes: &dyn HashSource,
        a: &AllocArgs<'_>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        debug_assert_eq!(known, self.coord.slot(req.request_id));
        let deferred = self.check_alloc(pool, known, req, a)?;
        let undo = deferred.undo;
        let existed = known.is_some();
        let slot = match known {
            Some(s) => s,
            None => self.coord.slot_or_insert(req.request_id),
        };
        // which groups already had a table for the request (vLLM's defaultdict entries)
        let had_table = GroupFlags::of(self.coord.managers.iter().map(|m| m.req(slot).is_some_and(|r| r.present)));
        let res = self.allocate_in_slot(pool, slot, req, hashes, a, deferred);
        // a refusal that leaves nothing behind: blocks that do not fit where vLLM would take
        // some before raising, or an assertion vLLM meets only after changing its state
        let refused = matches!(res, Err(Error::NotEnoughFreeBlocks { .. })) || (undo && res.is_err());
        if res.is_err() && (self.caller.is_kvblock() || refused) && !existed {
            // vLLM leaves the empty table its lookups made; kvblock's own API leaves nothing,
            // nor does a refusal where vLLM would take blocks before raising (kvblock takes none)
            self.coord.forget_if_blockless(req.request_id);
        } else if refused {
            // the same for a request known before: the empty tables this call made go again
            for (i, m) in self.coord.managers.iter_mut().enumerate() {
                if let Some(r) = m.reqs.get_mut(slot) {
                    if !had_table.get(i) && r.blocks.is_empty() {
                        r.present = false;
                    }
                }
            }
            self.coord.release_slot_if_vacant(slot, req.request_id);
        } else if !matches!(res, Ok(Some(_))) {
            self.coord.release_slot_if_vacant(slot, req.request_id);
        }
        res
    }

    fn allocate_in_slot(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        req: &RequestView<'_>,
        hashes: &dyn HashSource,
        a: &AllocArgs<'_>,
        deferred: Deferred,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let mut hits = hit_lists(a.new_computed, self.coord.num_groups());
        if let (Some(tier), Some(_)) = (self.coord.hisparse(), a.new_computed) {
            // `retained_hit_group_ids`: the host group keeps only the prefix the local and
            // external hits cover
            let h = tier.host_group();
            let reused = a.num_new_computed_tokens.saturating_add(a.num_external_computed_tokens);
            let keep = cdiv(reused, self.coord.managers[h].cfg.block_size);
            let lists = hits.to_mut();
            lists[h] = &lists[h][..keep.min(lists[h].len())];
        }
        let new_computed: &[&[u32]] = &hits;
        let num_local_computed = req.num_computed_tokens.saturating_add(a.num_new_computed_tokens);
        let total_uncapped = num_local_computed.saturating_add(a.num_external_computed_tokens);
        let total_computed = total_uncapped.min(self.max_model_len);
        let watermark = if a.has_scheduled_reqs && req.waiting_or_preempted { self.watermark_blocks } else { 0 };
        let prefill_end = req.num_prompt_tokens.max(req.num_tokens.saturating_sub(1));
        if a.full_sequence_must_fit {
            let full = req.num_tokens.min(self.max_model_len);
            let need = self.coord.get_num_blocks_to_allocate(
                pool,
                slot,
                req.request_id,
                full,
                new_computed,
                a.num_encoder_tokens,
                total_computed,
                num_local_computed,
                full,
                true,
                prefill_end,
            )?;
            if need + watermark as i64 > pool.num_free_blocks() as i64 {
                return Ok(None);
            }
        }
        let num_tokens_main = total_computed.saturating_add(a.num_new_tokens);
        let need_slot = num_tokens_main.saturating_add(a.num_lookahead_tokens).min(self.max_model_len);
        // blocks outside the attention window are freed even if the allocation then fails
        self.coord.remove_skipped_blocks(
            pool,
            slot,
            total_computed.saturating_sub(req.num_in_flight_tokens),
            Some(req.num_prompt_tokens),
        )?;
        let has_mamba = self.coord.managers.iter().any(|m| matches!(m.cfg.spec.kind, Kind::Mamba { .. }));
        // counting blocks sets Mamba prefill checkpoints (as vLLM's count does, kept when the
        // call then returns None); a refusal below that vLLM would only meet half way through
        // taking blocks puts them back, so that kvblock's refusal changes nothing
        let saved_checkpoints = if has_mamba { self.coord.checkpoints(slot) } else { Vec::new() };
        let need = self.coord.get_num_blocks_to_allocate(
            pool,
            slot,
            req.request_id,
            need_slot,
            new_computed,
            a.num_encoder_tokens,
            total_uncapped,
            num_local_computed,
            num_tokens_main,
            false,
            prefill_end,
        )?;
        let available = pool.num_free_blocks() as i64 - a.reserved_blocks as i64;
        if need + watermark as i64 > available {
            return Ok(None);
        }
        if let Some(e) = deferred.err {
            // where vLLM asserts, having freed the blocks outside the window as above
            if deferred.undo && has_mamba {
                self.coord.restore_checkpoints(slot, &saved_checkpoints);
            }
            return Err(e);
        }
        let adopts = a.new_computed.is_some() || a.num_external_computed_tokens > 0;
        let check_taken = (adopts && a.num_external_computed_tokens > 0) || has_mamba;
        if check_taken {
            let taken = self.coord.blocks_taken(
                pool,
                slot,
                req.request_id,
                adopts,
                new_computed,
                num_local_computed,
                a.num_external_computed_tokens,
                need_slot,
                num_tokens_main,
                a.num_encoder_tokens,
            );
            if taken > pool.num_free_blocks() {
                if has_mamba {
                    self.coord.restore_checkpoints(slot, &saved_checkpoints);
                }
                return Err(Error::NotEnoughFreeBlocks { requested: taken, free: pool.num_free_blocks() });
            }
        }
        if adopts {
            self.coord.allocate_new_computed_blocks(
                pool,
                slot,
                req.request_id,
                new_computed,
                num_local_computed,
                a.num_external_computed_tokens,
                a.skip_zeroing_group_ids,
            )?;
        }
        let new_blocks = self.coord.allocate_new_blocks(
            pool,
            slot,
            req.request_id,
            need_slot,
            num_tokens_main,
            a.num_encoder_tokens,
        )?;
        if a.delay_cache_blocks {
            return Ok(Some(new_blocks));
        }
        let to_cache = total_computed.saturating_add(a.num_new_tokens).min(req.num_tokens);
        self.cache_and_record(pool, slot, req, hashes, to_cache)?;
        Ok(Some(new_blocks))
    }

    /// True if `allocate_slots(request, ...)` with these arguments would change nothing and
    /// return no new blocks: a request that holds a table in every group, asks for slots its
    /// table already covers, adopts nothing, has no block leaving an attention window and no
    /// newly full block to cache (a decode step between block boundaries). Groups must be full
    /// attention, sliding window or HiSparse's at the hash block size (a HiSparse request's
    /// hot region settled and its host publication too, see
    /// `Coordinator::hisparse_tables_cover`); no watermark, no reserved blocks. With HiSparse
    /// groups the caller also checks that the device pool has no fired watcher waiting.
    /// For anything else this is false and the full path runs.
    pub fn allocate_is_noop(
        &self,
        request_id: &str,
        num_computed_tokens: usize,
        num_tokens: usize,
        num_in_flight_tokens: usize,
        a: &AllocArgs<'_>,
    ) -> bool {
        let Some(slot) = self.coord.slot(request_id) else { return false };
        self.allocate_is_noop_at(slot, num_computed_tokens, Some(num_tokens), Some(num_in_flight_tokens), a)
            .unwrap_or(false)
    }

    /// [`KVCacheManager::allocate_is_noop`] for the request in `slot`, with the request's
    /// token and in-flight counts read only if the answer needs them: None asks the caller
    /// for the counts it left out (`num_tokens` matters only when the call may have a newly
    /// full block to cache or the inputs are strict, `num_in_flight_tokens` only for sliding
    /// window groups). The binding answers vLLM's decode steps this way, reading nothing but
    /// `request.num_computed_tokens` from the request.
    #[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
    pub fn allocate_is_noop_at(
        &self,
        slot: usize,
        num_computed_tokens: usize,
        num_tokens: Option<usize>,
        num_in_flight_tokens: Option<usize>,
        a: &AllocArgs<'_>,
    ) -> Option<bool> {
        if !self.running_step_args(a) {
            return Some(false);
        }
        if self.caller.is_kvblock() && num_tokens? > self.max_model_len {
            return Some(false);
        }
        let total = num_computed_tokens.min(self.max_model_len);
        let need_slot =
            total.saturating_add(a.num_new_tokens).saturating_add(a.num_lookahead_tokens).min(self.max_model_len);
        let caches = self.enable_caching && !a.delay_cache_blocks;
        // an upper bound of the tokens computed after the call (the count itself caps it at
        // num_tokens): the cacheable count grows with it, so a cache that covers the bound
        // covers the count
        let computed_bound = total.saturating_add(a.num_new_tokens);
        // with every group plain full attention (fixed at construction), only the request's
        // tables are read: no group's kind, block size or caching flags
        let plain = self.plain_full_attention;
        let bs_plain = self.coord.hash_block_size;
        for (gid, m) in self.coord.managers.iter().enumerate() {
            let bs = if plain { bs_plain } else { m.cfg.block_size };
            if !plain {
                let kind_ok = matches!(m.cfg.spec.kind, Kind::FullAttention | Kind::SlidingWindow { .. });
                if (!kind_ok && !m.cfg.spec.kind.is_hisparse()) || bs != self.coord.hash_block_size {
                    return Some(false);
                }
                if m.cfg.spec.kind.is_hisparse() {
                    if !self.coord.hisparse_tables_cover(gid, slot, need_slot) {
                        return Some(false);
                    }
                    // the source group's publication: settled up to the bound of the tokens
                    // to cache, or else up to the count itself
                    if !a.delay_cache_blocks
                        && m.cfg.enable_caching
                        && m.cfg.spec.kind == Kind::HiSparseSource
                        && !self.coord.hisparse_publication_settled(gid, slot, computed_bound)
                        && !self.coord.hisparse_publication_settled(gid, slot, computed_bound.min(num_tokens?))
                    {
                        return Some(false);
                    }
                    continue;
                }
            }
            let Some(r) = m.req(slot) else { return Some(false) };
            if !r.present || r.partial_hit.is_some() || r.blocks.len().saturating_mul(bs) < need_slot {
                return Some(false);
            }
            if !plain && !matches!(m.cfg.spec.kind, Kind::FullAttention) {
                // the last block `remove_skipped_blocks` would free is null already
                let processed = total.saturating_sub(num_in_flight_tokens?);
                let skipped = (m.cfg.num_skipped_tokens(processed) / bs).min(r.blocks.len());
                if skipped != 0 && r.blocks[skipped - 1] != NULL_BLOCK {
                    return Some(false);
                }
            }
            if caches && (plain || (m.cfg.enable_caching && m.cfg.spec.prefix_cacheable)) {
                let Some(c) = r.num_cached else { return Some(false) };
                if c < self.coord.num_cacheable_tokens(computed_bound, gid) / bs {
                    let computed = computed_bound.min(num_tokens?);
                    if c < self.coord.num_cacheable_tokens(computed, gid) / bs {
                        return Some(false);
                    }
                }
            }
        }
        Some(true)
    }

    /// True if `cache_blocks(request, num_computed_tokens)` would change nothing: caching is
    /// off, or every group is full attention or sliding window at the hash block size and has
    /// cached every full block of those tokens already (vLLM's early return in `cache_blocks`).
    pub fn cache_is_noop(&self, request_id: &str, num_computed_tokens: usize) -> bool {
        if !self.enable_caching {
            return true;
        }
        let Some(slot) = self.coord.slot(request_id) else { return false };
        self.cache_is_noop_at(slot, num_computed_tokens)
    }

    /// True for the arguments of a running request's step (no hit blocks or external tokens
    /// to adopt, no encoder tokens, no reserve, no whole-sequence fit, no zeroing skipped) on a
    /// manager without a watermark: the calls [`KVCacheManager::allocate_is_noop_at`] and
    /// [`KVCacheManager::boundary_step_at`] answer.
    #[inline(always)]
    fn running_step_args(&self, a: &AllocArgs<'_>) -> bool {
        a.new_computed.is_none()
            && a.num_new_tokens != 0
            && a.num_new_computed_tokens == 0
            && a.num_external_computed_tokens == 0
            && a.num_encoder_tokens == 0
            && !a.full_sequence_must_fit
            && a.reserved_blocks == 0
            && a.skip_zeroing_group_ids.is_empty()
            && self.watermark_blocks == 0
    }

    /// For an `allocate_slots` call [`KVCacheManager::allocate_is_noop_at`] found not to be a
    /// no-op, on vLLM's manager ([`Caller::Vllm`]) whose groups are all plain full attention
    /// (no verify on hit), for
    /// the request in `slot` holding a table in each group with no partial hit: what the call
    /// does when it does one thing only (a decode step at a block boundary), else None (the
    /// full path runs). [`BoundaryStep::Grow`]: slots past its tables are asked for and nothing
    /// newly full waits to be cached; the blocks it takes over all groups, as
    /// `get_num_blocks_to_allocate` counts them for a running request.
    /// [`BoundaryStep::Cache`]: its tables cover the slots and a newly full block waits; the
    /// token count it caches up to. `num_tokens` is the request's token count.
    pub fn boundary_step_at(
        &self,
        slot: usize,
        num_computed_tokens: usize,
        num_tokens: usize,
        a: &AllocArgs<'_>,
    ) -> Option<BoundaryStep> {
        // vLLM's manager only: kvblock's own API (strict inputs) checks each call in full
        if !self.vllm_caller()
            || !self.plain_full_attention
            || self.verify.is_some()
            || a.delay_cache_blocks
            || !self.running_step_args(a)
        {
            return None;
        }
        let bs = self.coord.hash_block_size;
        let total = num_computed_tokens.min(self.max_model_len);
        let need_slot =
            total.saturating_add(a.num_new_tokens).saturating_add(a.num_lookahead_tokens).min(self.max_model_len);
        let to_cache = total.saturating_add(a.num_new_tokens).min(num_tokens);
        let (mut need, mut caches) = (0, false);
        for (gid, m) in self.coord.managers.iter().enumerate() {
            let r = m.req(slot)?;
            if !r.present || r.partial_hit.is_some() {
                return None;
            }
            if self.enable_caching {
                caches |= r.num_cached? < self.coord.num_cacheable_tokens(to_cache, gid) / bs;
            }
            need += cdiv(need_slot, bs).saturating_sub(r.blocks.len());
        }
        match (need, caches) {
            (0, true) => Some(BoundaryStep::Cache(to_cache)),
            (n, false) if n > 0 => Some(BoundaryStep::Grow(n)),
            _ => None,
        }
    }

    /// `allocate_slots` for a call [`KVCacheManager::boundary_step_at`] answered
    /// [`BoundaryStep::Grow`] for (the caller
    /// has checked that the pool holds that many free blocks): the new blocks appended to the
    /// request's tables, per group, exactly as the full path takes them (its remaining steps
    /// change nothing for such a call).
    pub fn allocate_growth_at(
        &mut self,
        pool: &mut BlockPool,
        slot: usize,
        request_id: &str,
        num_computed_tokens: usize,
        a: &AllocArgs<'_>,
    ) -> Result<Vec<Vec<u32>>> {
        let num_tokens_main = num_computed_tokens.min(self.max_model_len).saturating_add(a.num_new_tokens);
        let need_slot = num_tokens_main.saturating_add(a.num_lookahead_tokens).min(self.max_model_len);
        self.coord.allocate_new_blocks(pool, slot, request_id, need_slot, num_tokens_main, 0)
    }

    /// Start loading the manager's own fields that [`KVCacheManager::allocate_is_noop_at`] and
    /// [`KVCacheManager::cache_is_noop_at`] read, besides the request's entries (a hint, see
    /// [`crate::prefetch`]): for a caller about to ask, so that those misses overlap its own.
    #[inline(always)]
    pub fn prefetch_noop_reads(&self) {
        use crate::prefetch::prefetch_line as line;
        line((&self.max_model_len as *const usize).cast());
        line((&self.plain_full_attention as *const bool).cast());
        line((&self.coord.hash_block_size as *const usize).cast());
        line((&self.coord.managers as *const Vec<_>).cast());
        for m in &self.coord.managers {
            line((&m.reqs as *const Vec<_>).cast());
            line((&m.cfg as *const _ as *const u8).cast());
        }
    }

    /// [`KVCacheManager::cache_is_noop`] for the request in `slot`.
    #[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
    pub fn cache_is_noop_at(&self, slot: usize, num_computed_tokens: usize) -> bool {
        if !self.enable_caching {
            return true;
        }
        self.coord.managers.iter().enumerate().all(|(gid, m)| {
            let bs = m.cfg.block_size;
            matches!(m.cfg.spec.kind, Kind::FullAttention | Kind::SlidingWindow { .. })
                && bs == self.coord.hash_block_size
                && (!m.cfg.enable_caching
                    || !m.cfg.spec.prefix_cacheable
                    || m.req(slot).is_some_and(|r| {
                        r.num_cached
                            .is_some_and(|c| c >= self.coord.num_cacheable_tokens(num_computed_tokens, gid) / bs)
                    }))
        })
    }

    /// The hash indices an `allocate_slots` (or `cache_blocks`) call may read: check them
    /// before calling, so the call cannot fail half way on a malformed hash.
    pub fn cache_read_range(
        &self,
        req: &RequestView<'_>,
        a: Option<&AllocArgs<'_>>,
        num_hashes: usize,
    ) -> (usize, usize) {
        self.cache_read_range_in(self.coord.slot(req.request_id), req, a, num_hashes)
    }

    /// [`KVCacheManager::cache_read_range`] for a caller that knows the request's slot
    /// (`known`, as for [`KVCacheManager::allocate_slots_in`]).
    pub fn cache_read_range_in(
        &self,
        known: Option<usize>,
        req: &RequestView<'_>,
        a: Option<&AllocArgs<'_>>,
        num_hashes: usize,
    ) -> (usize, usize) {
        debug_assert_eq!(known, self.coord.slot(req.request_id));
        if !self.enable_caching {
            return (0, 0);
        }
        let n = match a {
            Some(a) => {
                if a.delay_cache_blocks {
                    return (0, 0);
                }
                let local = req.num_computed_tokens.saturating_add(a.num_new_computed_tokens);
                let total = local.saturating_add(a.num_external_computed_tokens).min(self.max_model_len);
                total.saturating_add(a.num_new_tokens).min(req.num_tokens)
            }
            None => req.num_computed_tokens,
        };
        match known {
            Some(slot) => self.coord.cache_read_range(slot, n, req.num_prompt_tokens, num_hashes),
            None => (0, (n / self.coord.hash_block_size).min(num_hashes)),
        }
    }

    /// True if the request is running (cached blocks tracked) or holds blocks in a group.
    pub fn holds_blocks(&self, request_id: &str) -> bool {
        let Some(slot) = self.coord.slot(request_id) else { return false };
        self.coord.is_running(slot)
            || self.coord.managers.iter().any(|m| m.req(slot).is_some_and(|r| r.present && !r.blocks.is_empty()))
    }

    /// `cache_blocks(request, num_computed_tokens)` (a no-op with caching off).
    pub fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        req: &RequestView<'_>,
        hashes: &dyn HashSource,
        num_computed_tokens: usize,
    ) -> Result<()> {
        if !self.enable_caching {
            return Ok(());
        }
        if self.verify.is_some() && req.content.is_none() {
            return Err(Error::Value("verify_hits: caching needs the request's tokens".into()));
        }
        let slot = self.coord.slot_or_insert(req.request_id);
        let res = self.cache_and_record(pool, slot, req, hashes, num_computed_tokens);
        self.coord.release_if_vacant(req.request_id);
        res
    }

    /// Group `group`'s own `cache_blocks(request, num_tokens, retention_interval,
    /// replay_boundaries=...)` (vLLM's `SingleTypeKVCacheManager.cache_blocks`, which the
    /// coordinator calls per group with the cacheable prefix of that group).
    #[allow(clippy::too_many_arguments)] // vLLM's signature, plus the group
    pub fn group_cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        group: usize,
        req: &RequestView<'_>,
        hashes: &dyn HashSource,
        num_tokens: usize,
        retention_interval: Option<usize>,
        replay_boundaries: &[usize],
    ) -> Result<()> {
        if group >= self.coord.managers.len() {
            return Err(Error::value("group", format!("{group} is out of range")));
        }
        if self.verify.is_some() {
            return Err(Error::Value("verify_hits: cache through the manager's cache_blocks, not a group's".into()));
        }
        let slot = self.coord.slot_or_insert(req.request_id);
        let res = self.coord.managers[group].cache_blocks(
            pool,
            slot,
            &req.info(),
            hashes,
            num_tokens,
            retention_interval,
            replay_boundaries,
        );
        self.coord.release_if_vacant(req.request_id);
        res
    }

    /// `free(request)` (as [`KVCacheManager::free_request`] for a finished request).
    pub fn free(&mut self, pool: &mut BlockPool, request_id: &str) -> Result<()> {
        self.free_request(pool, request_id, true)
    }

    /// `free(request)`, with `finished` = `request.is_finished()` (HiSparse's coordinator
    /// keeps a finished request's host blocks until its running spills publish them; see
    /// [`Coordinator::free_request`]).
    pub fn free_request(&mut self, pool: &mut BlockPool, request_id: &str, finished: bool) -> Result<()> {
        self.retention.apply_on_free(&self.coord, pool, request_id);
        self.coord.free_request(pool, request_id, finished)
    }

    /// `remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)`.
    pub fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        request_id: &str,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        let slot = self.coord.slot_or_insert(request_id);
        let res = self.coord.remove_skipped_blocks(pool, slot, processed_computed_tokens, num_prompt_tokens);
        self.coord.release_if_vacant(request_id);
        res
    }

    /// `estimate_cached_tokens(request)`: the shortest over the prefix-cacheable attention
    /// groups of the longest prefix its blocks are keyed at.
    pub fn estimate_cached_tokens(&self, pool: &BlockPool, request_id: &str) -> Result<usize> {
        let tables = self.coord.get_blocks(request_id);
        let mut est: Option<usize> = None;
        for (i, (m, blocks)) in self.coord.managers.iter().zip(tables).enumerate() {
            if !m.cfg.spec.prefix_cacheable || m.cfg.spec.kind == Kind::CrossAttention {
                continue;
            }
            let pool = self.coord.pool_of(i, pool);
            let mut g = 0;
            for &b in blocks {
                g = g.max(pool.block_hash_num_tokens(b)?.unwrap_or(0));
            }
            est = Some(est.map_or(g, |e| e.min(g)));
        }
        Ok(est.unwrap_or(0))
    }

    /// `record_blocks_for_zeroing(request_id, start_token)`.
    pub fn record_blocks_for_zeroing(&mut self, request_id: &str, start_token: usize) -> Result<()> {
        for m in &self.coord.managers {
            if m.cfg.record_new_block_ids && !start_token.is_multiple_of(m.cfg.block_size) {
                return Err(Error::Assertion(format!(
                    "start_token {start_token} is not a multiple of the block size {}",
                    m.cfg.block_size
                )));
            }
        }
        let slot = self.coord.slot_or_insert(request_id);
        for m in &mut self.coord.managers {
            if m.cfg.record_new_block_ids {
                let start = start_token / m.cfg.block_size;
                let r = &mut m.reqs[slot];
                r.present = true;
                let ids: Vec<u32> = r.blocks.iter().skip(start).copied().collect();
                m.st.new_block_ids.extend(ids);
            }
        }
        Ok(())
    }

    /// `take_new_block_ids`.
    /// HiSparse's source group records no new block ids (its host copy-on-write copy is
    /// not zeroed on the device): its list is cleared and left out.
    pub fn take_new_block_ids(&mut self) -> Vec<u32> {
        let host_group = self.coord.hisparse().map(|t| t.host_group());
        let mut out = Vec::new();
        for (i, m) in self.coord.managers.iter_mut().enumerate() {
            let ids = m.take_new_block_ids();
            if host_group != Some(i) {
                out.extend(ids);
            }
        }
        out
    }

    /// `take_kv_cache_block_copies`: the pending copy-on-write (source, copy) pairs.
    /// HiSparse's source group hands none here (its host copies go to the connector through
    /// the coordinator's `take_host_block_copies`, and stay pending for it).
    pub fn take_kv_cache_block_copies(&mut self) -> Vec<(u32, u32)> {
        let host_group = self.coord.hisparse().map(|t| t.host_group());
        let mut out = Vec::new();
        for (i, m) in self.coord.managers.iter_mut().enumerate() {
            if host_group != Some(i) {
                out.extend(m.take_pending_cow_copies());
            }
        }
        out
    }

    /// `take_boundary_state_offloads`: (request id, group, block, boundary tokens).
    pub fn take_boundary_state_offloads(&mut self) -> Vec<(String, u32, u32, usize)> {
        self.coord.managers.iter_mut().flat_map(|m| m.take_pending_offloads()).collect()
    }

    /// `finalize_partial_tail_offloads(request)`.
    pub fn finalize_partial_tail_offloads(
        &mut self,
        request_id: &str,
        num_computed_tokens: usize,
        num_in_flight_tokens: usize,
    ) -> Vec<(u32, u32, usize)> {
        let Some(slot) = self.coord.slot(request_id) else { return Vec::new() };
        let out = self
            .coord
            .managers
            .iter_mut()
            .filter_map(|m| m.finalize_partial_tail_offload(slot, num_computed_tokens, num_in_flight_tokens))
            .collect();
        self.coord.release_if_vacant(request_id);
        out
    }
}
