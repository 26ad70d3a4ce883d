//! `ManagerState`'s steps on request objects: what each `KVCacheManagerCore` call does once
//! its arguments are read.

use super::*;

impl ManagerState {
    /// With verify on hit, the request's blocks `first..end` (see [`ContentReader::read`]);
    /// None when it is off.
    pub(super) fn content(
        &self,
        request: &Bound<'_, PyAny>,
        first: usize,
        end: usize,
    ) -> PyResult<Option<BlockContent>> {
        match (&self.reader, &self.inner.verify) {
            (Some(r), Some(_)) => r.read(&self.fields, request, first, end).map(Some),
            _ => Ok(None),
        }
    }

    /// The content a verified lookup of up to `max_len` tokens reads (blocks from 0), or None
    /// with verify on hit off.
    pub(super) fn lookup_content(
        &self,
        request: &Bound<'_, PyAny>,
        hashes: &PyHashes<'_>,
        max_len: usize,
    ) -> PyResult<Option<BlockContent>> {
        if self.inner.verify.is_none() {
            return Ok(None);
        }
        let h = self.inner.coord.hash_block_size;
        self.content(request, 0, hashes.0.len().min(max_len / h))
    }

    /// kvblock's own API: a request this manager holds no block table for must be new. One
    /// with computed tokens (`request.num_computed_tokens > 0`: freed, or decoded after
    /// `free`) or finished (`request.is_finished`, a property or a method, where the request has it) is refused
    /// with a `ValueError` naming it: allocating it would cache blocks nobody computed under
    /// its hashes (and announce them in `BlockStored`). vLLM's callers are not checked (vLLM
    /// allocates such a request a new table).
    pub(super) fn check_new_request(&self, request: &Bound<'_, PyAny>, v: &ReqView<'_>) -> PyResult<()> {
        if !self.inner.caller.is_kvblock() {
            return Ok(());
        }
        let id = request_id_str(&v.id)?;
        if v.num_computed > 0 {
            return Err(value_err(
                "request",
                format!(
                    "request {id:?} holds no blocks in this manager but has {} computed tokens (freed or \
                     finished?): its KV is gone; admit it again from num_computed_tokens = 0",
                    v.num_computed
                ),
            ));
        }
        let py = request.py();
        let finished = match request.getattr(Field::IsFinished.interned(py)) {
            // vLLM's is a method, kvblock's `Request` has a property
            Ok(m) if m.is_callable() => m.call0()?.is_truthy()?,
            Ok(m) => m.is_truthy()?,
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => false,
            Err(e) => return Err(e),
        };
        if finished {
            let status = match request.getattr(Field::Status.interned(py)) {
                // an enum member by its name (an IntEnum's str is its int)
                Ok(s) => s.getattr("name").unwrap_or(s).str().map(|s| s.to_string()).unwrap_or_else(|_| "?".into()),
                Err(_) => "finished".into(),
            };
            return Err(value_err(
                "request",
                format!("request {id:?} is finished ({status}): a finished request gets no blocks"),
            ));
        }
        Ok(())
    }

    /// Refuse a lookup by block hashes alone while verify on hit is on (it could not verify).
    pub(super) fn hashes_only_lookup(&self, what: &str) -> PyResult<()> {
        if self.inner.verify.is_some() {
            return Err(value_err(
                what,
                "verify_hits is on: a lookup by block hashes alone cannot verify its hits; use get_computed_blocks",
            ));
        }
        Ok(())
    }

    pub(super) fn view<'py>(&self, request: &Bound<'py, PyAny>, has_scheduled_reqs: bool) -> PyResult<ReqView<'py>> {
        self.view_after(request, has_scheduled_reqs, Prior::default())
    }

    /// [`ManagerState::view`] of a request whose fields in `prior` were read already by this
    /// call (its slot lookup and no-op check): each field is read once per call.
    pub(super) fn view_after<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        has_scheduled_reqs: bool,
        prior: Prior<'py>,
    ) -> PyResult<ReqView<'py>> {
        let f = &self.fields;
        let id = match prior.id {
            Some(id) => id,
            None => self.id_of(request)?,
        };
        let num_computed = match prior.num_computed {
            Some(n) => n,
            None => field_count(&f.get(request, Field::NumComputedTokens)?, "request.num_computed_tokens")?,
        };
        let num_tokens = match (prior.counts, prior.num_tokens) {
            (Some((n, _)), _) | (None, Some(n)) => n,
            (None, None) => self.num_tokens(request)?,
        };
        let num_prompt_tokens = match self.vllm_field(request, Field::NumPromptTokens)? {
            Some(v) => field_count(&v, "request.num_prompt_tokens")?,
            None => num_tokens,
        };
        let num_in_flight_tokens = match prior.counts {
            Some((_, n)) => n,
            None => self.in_flight(request)?,
        };
        let shared_prefix_boundary =
            opt_field_count(f, request, Field::SharedPrefixBoundary, "request.shared_prefix_boundary")?;
        let waiting = self.watermark_applies(request, has_scheduled_reqs)?;
        Ok(ReqView {
            id,
            num_computed,
            num_tokens,
            num_prompt_tokens,
            num_in_flight_tokens,
            shared_prefix_boundary,
            waiting,
        })
    }

    /// The retention of a request this manager does not know yet (read with retention on
    /// only; None for one it knows, or one without `retention` / `retention_priority`).
    pub(super) fn new_request_retention(
        &self,
        request: &Bound<'_, PyAny>,
        v: &ReqView<'_>,
    ) -> PyResult<Option<crate::manager::retention::RequestRetention>> {
        if self.pool.get().state.borrow(request.py())?.inner.retention().is_none() {
            return Ok(None);
        }
        let id = request_id_str(&v.id)?;
        if self.inner.retention.requests.contains_key(id) || self.inner.holds_blocks(id) {
            return Ok(None);
        }
        crate::py::retention::request_retention(request, v.num_prompt_tokens)
    }

    /// The request's `num_tokens` and `num_in_flight_tokens`, as [`ManagerState::view`] reads
    /// them: what deciding [`KVCacheManager::allocate_is_noop_at`] takes beyond
    /// `num_computed_tokens` at a block boundary.
    pub(super) fn token_counts(&self, request: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
        let num_tokens = self.num_tokens(request)?;
        Ok((num_tokens, self.in_flight(request)?))
    }

    /// A field vLLM's `allocate_slots` reads on every call (`num_prompt_tokens`,
    /// `num_in_flight_tokens`): required on the vLLM manager (a request lacking it raises
    /// vLLM's `AttributeError`), optional (None when missing) on kvblock's own.
    pub(super) fn vllm_field<'py>(&self, request: &Bound<'py, PyAny>, f: Field) -> PyResult<Option<Bound<'py, PyAny>>> {
        if self.inner.caller.is_kvblock() {
            self.fields.get_opt(request, f)
        } else {
            self.fields.get(request, f).map(Some)
        }
    }

    /// `request.num_in_flight_tokens` (see [`ManagerState::vllm_field`]; 0 when missing).
    pub(super) fn in_flight(&self, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        match self.vllm_field(request, Field::NumInFlightTokens)? {
            Some(v) => field_count(&v, "request.num_in_flight_tokens"),
            None => Ok(0),
        }
    }

    /// `request.num_tokens`. For the registered request type (vLLM's `Request`, whose property
    /// is this) the length of its token list; any other type's own `num_tokens` (a subclass
    /// may override it), or its token list's length when it has no such attribute (kvblock's
    /// own manager only).
    pub(super) fn num_tokens(&self, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        let py = request.py();
        if self.fields.is_exact_type(request) {
            if let Some(t) = self.fields.get_opt(request, Field::AllTokenIds)? {
                return t.len();
            }
        }
        match request.getattr(Field::NumTokens.interned(py)) {
            Ok(n) => field_count(&n, "request.num_tokens"),
            Err(e) if self.inner.caller.is_kvblock() && e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => {
                match self.fields.get_opt(request, Field::AllTokenIds)? {
                    Some(t) => t.len(),
                    None => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// `allocate_slots` once its arguments are read (`adopts_hits`: `args.new_computed` holds
    /// the hit blocks passed). A decode step between block boundaries is answered from the
    /// request object and its `num_computed_tokens` (its token and in-flight counts only when
    /// needed); otherwise the request's view, hashes and content are read and checked, then
    /// the allocation is made in the pool.
    #[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
    pub(super) fn allocate<'py>(
        &mut self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: &AllocArgs<'_>,
        adopts_hits: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let me = self;
        let mut known = None;
        let mut prior = Prior::default();
        if !adopts_hits {
            let id;
            (known, id) = me.known_slot(request)?;
            prior.id = id;
            if let Some(slot) = known {
                if me.noop_at(request, slot, args, &mut prior)? {
                    return me.empty(py);
                }
                if let Some(blocks) = me.boundary_at(py, request, slot, args, &mut prior)? {
                    return Ok(blocks);
                }
            }
        }
        me.allocate_work(py, request, args, adopts_hits, known, prior)
    }

    /// `allocate_slots` for a running request at a block boundary, when the call does one
    /// thing only ([`KVCacheManager::boundary_step_at`]): append blocks to the request's
    /// tables (taken and returned here, without the full path's other reads and checks, which
    /// change nothing for such a call), or cache its newly full blocks (as `cache_blocks` does,
    /// returning the empty `KVCacheBlocks`). It reads `request.request_id` and
    /// `request.num_tokens` in the full path's order (their errors are the full path's) and
    /// keeps them in `prior`; the caching reads the rest of the request's view as the full
    /// path does. None, with nothing changed, for any other call and where the full path has
    /// more to do: the pool short of blocks (the full path then returns None), KV events or
    /// retention on, or the fast paths off (`KVBLOCK_NO_FAST_PATHS`: that run keeps the full
    /// path's answers to compare).
    #[inline(never)]
    fn boundary_at<'py>(
        &mut self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        slot: usize,
        args: &AllocArgs<'_>,
        prior: &mut Prior<'py>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let me = self;
        if !me.inner.plain_full_attention || !crate::py::fast::enabled() || me.inner.retention.has_ttl_pins() {
            return Ok(None);
        }
        let Some(num_computed) = prior.num_computed else { return Ok(None) };
        let pool = me.pool.bind(py).clone();
        let (free, plain_pool) = {
            let p = pool.get().state.borrow(py)?;
            (p.inner.num_free_blocks(), !p.inner.events_enabled() && p.inner.retention().is_none())
        };
        if !plain_pool {
            return Ok(None);
        }
        let id = match &prior.id {
            Some(id) => id.clone(),
            None => {
                let id = me.id_of(request)?;
                prior.id = Some(id.clone());
                id
            }
        };
        let num_tokens = match (prior.counts, prior.num_tokens) {
            (Some((n, _)), _) | (None, Some(n)) => n,
            (None, None) => {
                let n = me.num_tokens(request)?;
                prior.num_tokens = Some(n);
                n
            }
        };
        match me.inner.boundary_step_at(slot, num_computed, num_tokens, args) {
            Some(BoundaryStep::Grow(need)) if need <= free => {
                let mut p = pool.get().state.borrow_mut(py)?;
                let new = me.inner.allocate_growth_at(&mut p.inner, slot, request_id_str(&id)?, num_computed, args);
                sync_kept_tags(&me.inner.coord, &mut p);
                drop(p);
                me.boundary_calls[0] += 1;
                me.blocks_of(py, new.py_err()?).map(Some)
            }
            Some(BoundaryStep::Cache(to_cache)) => {
                me.cache_work(py, request, to_cache, std::mem::take(prior))?;
                me.boundary_calls[1] += 1;
                me.empty(py).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// [`ManagerState::allocate`] past its no-op check: `known` and `prior` are what the check
    /// found and read. Kept out of line, so that the no-op check's code stays small and
    /// together in the `.text.kvblock_hot` section with the checks it calls.
    #[inline(never)]
    fn allocate_work<'py>(
        &mut self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: &AllocArgs<'_>,
        adopts_hits: bool,
        known: Option<usize>,
        prior: Prior<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let me = self;
        let v = me.view_after(request, args.has_scheduled_reqs, prior)?;
        // the slot found for the request object, if it is its id's slot (else looked up by id)
        let known = match known {
            Some(slot) if me.slots.slot_has_id(request, slot, &v.id) => Some(slot),
            _ => me.inner.coord.slot(request_id_str(&v.id)?),
        };
        if known.is_none() {
            me.check_new_request(request, &v)?;
        }
        let ret = me.new_request_retention(request, &v)?;
        let hashes = if me.inner.enable_caching { me.hashes(request)? } else { PyHashes::empty(py) };
        let content = {
            let (lo, hi) = me.inner.cache_read_range_in(known, &v.as_view(0)?, Some(args), hashes.0.len());
            hashes.check(lo, hi)?;
            // adopted hit blocks are not recorded again: their positions need no content
            let recorded_from =
                if adopts_hits { args.num_new_computed_tokens / me.inner.coord.hash_block_size } else { 0 };
            me.content(request, lo.max(recorded_from), hi)?
        };
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let events = me.event_inputs(request, p.inner.events_enabled())?;
        crate::py::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        let res =
            tagged_call(&mut me.inner, &mut p, request, events.as_ref(), &v, content.as_ref(), |m, pool, view| {
                m.allocate_slots_in(pool, known, view, &hashes, args)
            });
        drop(p);
        match res? {
            None => Ok(py.None().into_bound(py)),
            Some(new) => {
                if let Some(r) = ret {
                    me.inner.retention.requests.insert(request_id_str(&v.id)?.to_owned(), r);
                }
                me.blocks_of(py, new)
            }
        }
    }

    /// Start loading what a no-op `allocate_slots` (`allocate`) or `cache_blocks` reads
    /// besides the request (hints, see [`crate::prefetch`]): its slot cache entry, the
    /// manager's fields the no-op checks read, the names of the fields read from the request's
    /// dict, and (`allocate`) the shared empty result. Inside a scheduler step all of these
    /// are cold; loaded together at the call's start, their misses overlap instead of
    /// following one another through the call.
    #[inline(always)]
    pub(super) fn prefetch_noop(&self, request: &Bound<'_, PyAny>, allocate: bool) {
        self.slots.prefetch(request);
        self.inner.prefetch_noop_reads();
        self.fields.prefetch_name(Field::RequestId);
        if allocate {
            self.fields.prefetch_name(Field::NumComputedTokens);
            if let Some(e) = &self.empty {
                crate::prefetch::prefetch_line(e.as_ptr().cast());
            }
        }
    }

    /// `cache_blocks(request, n)` once `n` is read: nothing to do with caching off or with no
    /// newly full block (then only the request's slot is looked up), else the request's view
    /// and hashes are read and checked and its newly full blocks cached.
    #[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
    pub(super) fn cache(&mut self, py: Python<'_>, request: &Bound<'_, PyAny>, n: usize) -> PyResult<()> {
        let me = self;
        if !me.inner.enable_caching {
            return Ok(());
        }
        // nothing newly full to cache: vLLM reads only the request id then
        let (known, id) = me.known_slot(request)?;
        if let Some(slot) = known {
            if me.inner.cache_is_noop_at(slot, n) {
                return Ok(());
            }
        }
        me.cache_work(py, request, n, Prior { id, ..Prior::default() })
    }

    /// [`ManagerState::cache`] past its no-op check (out of line, as `allocate_work`).
    #[inline(never)]
    fn cache_work<'py>(
        &mut self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        n: usize,
        prior: Prior<'py>,
    ) -> PyResult<()> {
        let me = self;
        let v = me.view_after(request, false, prior)?;
        let hashes = me.hashes(request)?;
        let content = {
            let mut rv = v.as_view(0)?;
            rv.num_computed_tokens = n;
            let (lo, hi) = me.inner.cache_read_range(&rv, None, hashes.0.len());
            hashes.check(lo, hi)?;
            me.content(request, lo, hi)?
        };
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let events = me.event_inputs(request, p.inner.events_enabled())?;
        tagged_call(&mut me.inner, &mut p, request, events.as_ref(), &v, content.as_ref(), |m, pool, view| {
            m.cache_blocks(pool, view, &hashes, n)
        })
    }

    /// True if `allocate_slots(request, ...)` with `args` (no hit blocks) changes nothing for
    /// the request in `slot` ([`KVCacheManager::allocate_is_noop_at`]): reads
    /// `request.num_computed_tokens`, and its token and in-flight counts only when needed
    /// (at a block boundary); the slot cache has already checked its id. What it read goes
    /// into `prior`, for [`ManagerState::view_after`].
    #[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
    pub(super) fn noop_at(
        &self,
        request: &Bound<'_, PyAny>,
        slot: usize,
        args: &AllocArgs<'_>,
        prior: &mut Prior<'_>,
    ) -> PyResult<bool> {
        let f = &self.fields;
        let num_computed = field_count(&f.get(request, Field::NumComputedTokens)?, "request.num_computed_tokens")?;
        prior.num_computed = Some(num_computed);
        let mut noop = self.inner.allocate_is_noop_at(slot, num_computed, None, None, args);
        if noop.is_none() {
            let (num_tokens, in_flight) = self.token_counts(request)?;
            prior.counts = Some((num_tokens, in_flight));
            noop = self.inner.allocate_is_noop_at(slot, num_computed, Some(num_tokens), Some(in_flight), args);
        }
        if noop == Some(true) && self.inner.coord.hisparse().is_some() {
            // the full path drains the residency's fired reuse watchers: none may wait
            return Ok(!self.pool.bind(request.py()).get().state.borrow(request.py())?.inner.has_fired_watchers());
        }
        Ok(noop == Some(true))
    }

    /// The coordinator slot of a request this manager holds, found from the request object's
    /// address when it was seen before (see `fast/slot_cache.rs`), else from its id's characters;
    /// None for a request the manager does not hold. Also returns the `request_id` it read, if
    /// it read one (for [`ManagerState::view_after`]).
    #[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
    pub(super) fn known_slot<'py>(
        &mut self,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<(Option<usize>, Option<Bound<'py, PyString>>)> {
        let coord = &self.inner.coord;
        let mut read = None;
        let hit = self.slots.get(
            request,
            || self.fields.get_borrowed(request, Field::RequestId),
            || {
                let id = self.id_of(request)?;
                read = Some(id.clone());
                Ok(id)
            },
            |s| coord.slot_generation(s),
            |s| coord.prefetch_request(s),
        )?;
        if hit.is_some() {
            return Ok((hit, read));
        }
        let id = match read {
            Some(id) => id,
            None => self.id_of(request)?,
        };
        let Some((slot, generation)) = coord.slot_and_generation(request_id_str(&id)?) else {
            return Ok((None, Some(id)));
        };
        self.slots.insert(request, &id, slot, generation);
        Ok((Some(slot), Some(id)))
    }

    /// `ValueError("group: out of range")` unless the manager has a group `group`.
    pub(super) fn check_group(&self, group: usize) -> PyResult<()> {
        if group >= self.inner.coord.num_groups() {
            return Err(value_err("group", "out of range"));
        }
        Ok(())
    }

    /// `request.request_id` (a `str`).
    pub(super) fn id_of<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
        self.fields
            .get(request, Field::RequestId)?
            .cast_into::<PyString>()
            .map_err(|_| type_err("request.request_id", "must be a str"))
    }

    /// The request's block hashes. kvblock's own API (strict inputs) refuses a request
    /// holding more hashes than `num_tokens / hash_block_size`: it was hashed at a smaller
    /// block size than the manager's, and its hashes would claim hits for tokens they do not
    /// cover.
    pub(super) fn hashes<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<PyHashes<'py>> {
        let hashes = PyHashes::of(self.fields.get(request, Field::BlockHashes)?, "request.block_hashes")?;
        if self.inner.caller.is_kvblock() && !hashes.0.is_empty() {
            let num_tokens = self.num_tokens(request)?;
            let h = self.inner.coord.hash_block_size;
            if let Ok(hb) = request.getattr(Field::HashBlockSize.interned(request.py())) {
                let hb: usize = hb.extract().unwrap_or(0);
                if hb != 0 && hb != h {
                    return Err(value_err(
                        "request.block_hashes",
                        format!(
                            "the request's block hasher hashes {hb}-token blocks, the manager's hash_block_size \
                             is {h} (build it with the manager's request_block_hasher)"
                        ),
                    ));
                }
            }
            if hashes.0.len() > num_tokens / h {
                return Err(value_err(
                    "request.block_hashes",
                    format!(
                        "{} hashes for {num_tokens} tokens: the request was hashed at a smaller block size than \
                         the manager's hash_block_size {h} (build it with the manager's request_block_hasher)",
                        hashes.0.len()
                    ),
                ));
            }
        }
        Ok(hashes)
    }

    pub(super) fn blocks_of<'py>(&self, py: Python<'py>, groups: Vec<Vec<u32>>) -> PyResult<Bound<'py, PyAny>> {
        if groups.iter().all(|g| g.is_empty()) {
            return self.empty(py);
        }
        let make = self.make_blocks.as_ref().ok_or_else(not_initialised)?;
        let ids = groups
            .into_iter()
            .map(|ids| Bound::new(py, PyBlockIds { ids, generations: None }))
            .collect::<PyResult<Vec<_>>>()?;
        let ids = PyTuple::new(py, ids)?;
        make.make(py, &[ids.as_any(), self.pool.bind(py).as_any(), &py.None().into_bound(py)])
    }

    /// [`ManagerState::blocks_of`] for a lookup's hits, each group's `BlockIds` carrying the
    /// blocks' generations now (kvblock's stale-hit check).
    pub(super) fn hits_of<'py>(&self, py: Python<'py>, groups: Vec<Vec<u32>>) -> PyResult<Bound<'py, PyAny>> {
        if groups.iter().all(|g| g.is_empty()) {
            return self.empty(py);
        }
        let make = self.make_blocks.as_ref().ok_or_else(not_initialised)?;
        let p = self.pool.get().state.borrow(py)?;
        let ids = groups
            .into_iter()
            .map(|ids| {
                let generations = Some(ids.iter().map(|&b| p.inner.generation_of(b)).collect());
                Bound::new(py, PyBlockIds { ids, generations })
            })
            .collect::<PyResult<Vec<_>>>()?;
        drop(p);
        let ids = PyTuple::new(py, ids)?;
        make.make(py, &[ids.as_any(), self.pool.bind(py).as_any(), &py.None().into_bound(py)])
    }

    pub(super) fn empty<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match &self.empty {
            Some(e) => Ok(e.bind(py).clone()),
            None => Err(not_initialised()),
        }
    }

    pub(super) fn watermark_applies(&self, request: &Bound<'_, PyAny>, has_scheduled_reqs: bool) -> PyResult<bool> {
        if self.inner.watermark_blocks == 0 || !has_scheduled_reqs {
            return Ok(false);
        }
        let status = self.fields.get(request, Field::Status)?;
        match &self.waiting_states {
            Some((w, p)) => Ok(status.eq(w.bind(request.py()))? || status.eq(p.bind(request.py()))?),
            None => Ok(false),
        }
    }

    /// What a `BlockStored` from caching this request's blocks reports, read now (None with
    /// events off).
    #[inline(always)]
    pub(super) fn event_inputs<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        events_enabled: bool,
    ) -> PyResult<Option<EventInputs<'py>>> {
        if !events_enabled {
            return Ok(None);
        }
        // a list, or vLLM 0.34's TokenBuffer (read in place); anything else is read by `read`
        let tokens = self.fields.get_opt(request, Field::AllTokenIds)?;
        EventInputs::read(&self.fields, request, tokens.as_ref()).map(Some)
    }

    /// How much of its prefix the request may read from the cache: nothing with caching off;
    /// otherwise as its hit-limit field says (`HitLimit`, chosen by the caller's vLLM release).
    pub(super) fn cache_read(&self, request: &Bound<'_, PyAny>) -> PyResult<CacheRead> {
        if !self.inner.enable_caching {
            return Ok(CacheRead::Off);
        }
        match self.hit_limit {
            HitLimit::SkipFlag => {
                let skip = self.fields.get(request, Field::SkipReadingPrefixCache)?.is_truthy()?;
                Ok(if skip { CacheRead::Off } else { CacheRead::Unbounded })
            }
            HitLimit::TokenLimit => {
                let limit = self.fields.get(request, Field::PrefixCacheHitLimit)?;
                if limit.is_none() {
                    return Ok(CacheRead::Unbounded);
                }
                // vLLM compares it with `!= 0` and takes it as a `min` bound: an int; a bool
                // counts as 0 or 1, as in vLLM
                let n = match crate::py::args::bool_count(&limit) {
                    Some(n) => n,
                    None => crate::py::args::count(&limit, "request.prefix_cache_hit_limit")?,
                };
                Ok(if n == 0 { CacheRead::Off } else { CacheRead::AtMost(n) })
            }
        }
    }

    /// True if the request reads the prefix cache (`cache_read` is not `Off`).
    pub(super) fn reads_cache(&self, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(!matches!(self.cache_read(request)?, CacheRead::Off))
    }

    /// `max_cache_hit_length` as vLLM's `get_computed_blocks` takes it: a bool as 0 or 1. A
    /// float or a negative int is vLLM's error where a full-attention group takes part (its
    /// `islice` raises `ValueError`); without one (sliding window, chunked local, Mamba) a
    /// float is a `TypeError` and a negative length a miss, as their `range`s make them.
    pub(super) fn vllm_max_cache_hit_length(&self, m: &Bound<'_, PyAny>) -> PyResult<usize> {
        let arg = "max_cache_hit_length";
        if let Some(n) = crate::py::args::bool_count(m) {
            return Ok(n);
        }
        let full = self.inner.coord.managers.iter().any(|t| t.cfg.spec.kind.is_full_attention());
        if m.is_instance_of::<pyo3::types::PyFloat>() {
            let msg = "expected int, got float";
            return Err(if full { value_err(arg, msg) } else { type_err(arg, msg) });
        }
        let v = crate::py::args::int64(m, arg)?;
        match usize::try_from(v) {
            Ok(v) => Ok(v),
            Err(_) if full => Err(negative_count(v, arg)),
            Err(_) => Ok(0),
        }
    }

    /// `record_blocks_for_zeroing`'s `start_token` as vLLM's loop reads it: first
    /// `start_token % block_size == 0` for the first group that records (Python's own `%`, so
    /// its `TypeError` for a non-number and vLLM's `AssertionError` for a misaligned value,
    /// `True` and `-1` included), then the aligned value as a count (a bool is 0 or 1; a
    /// float is the `TypeError` vLLM's slice raises; a negative or huge int, which vLLM
    /// slices from the end or past it, is refused).
    pub(super) fn vllm_start_token(&self, start_token: &Bound<'_, PyAny>) -> PyResult<usize> {
        let arg = "start_token";
        if let Some(m) = self.inner.coord.managers.iter().find(|m| m.cfg.record_new_block_ids) {
            let bs = m.cfg.block_size;
            if !start_token.rem(bs)?.eq(0)? {
                return Err(pyo3::exceptions::PyAssertionError::new_err(format!(
                    "{arg}: {start_token} is not a multiple of the block size {bs}"
                )));
            }
        }
        crate::py::args::vllm_count(start_token, arg)
    }

    /// The block ids per group of the request `request_id` (see [`id_arg`]; empty lists for
    /// an unknown request).
    pub(super) fn block_ids(&self, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        Ok(match id_arg(request_id, self.inner.vllm_caller())? {
            Some(id) => self.inner.coord.get_blocks(id).into_iter().map(|b| b.to_vec()).collect(),
            None => vec![Vec::new(); self.inner.coord.num_groups()],
        })
    }

    /// True if no group frees blocks as a request's computed tokens grow (full and cross
    /// attention only): vLLM's `remove_skipped_blocks` then returns before reading its
    /// arguments.
    pub(super) fn never_skips(&self) -> bool {
        self.inner.coord.managers.iter().all(|t| matches!(t.cfg.spec.kind, Kind::FullAttention | Kind::CrossAttention))
    }

    /// `kv_cache_report_mode == "full"` with events on: a hit publishes `BlockStored`.
    pub(super) fn reports_hits(&self, request: &Bound<'_, PyAny>, events_enabled: bool) -> PyResult<bool> {
        if !events_enabled {
            return Ok(false);
        }
        let mode = self.fields.get_opt(request, Field::KvCacheReportMode)?;
        Ok(mode.map(|m| m.eq("full")).transpose()?.unwrap_or(false))
    }

    /// `get_computed_blocks` without the result object: hit blocks per group, hit length and
    /// shared-prefix boundary (and the `BlockStored` of a "full" report-mode hit).
    pub(super) fn lookup(
        &mut self,
        request: &Bound<'_, PyAny>,
        num_tokens: usize,
        max_cache_hit_length: Option<usize>,
    ) -> PyResult<(Vec<Vec<u32>>, usize, usize)> {
        let py = request.py();
        let max_cache_hit_length = match self.cache_read(request)? {
            CacheRead::Off => return Ok((vec![Vec::new(); self.inner.coord.num_groups()], 0, 0)),
            CacheRead::Unbounded => max_cache_hit_length,
            // vLLM 0.34's `request.get_max_cache_hit_length(bound)`: the least of
            // `num_tokens - 1`, the request's limit and the bound
            CacheRead::AtMost(limit) => {
                let num_tokens = match max_cache_hit_length {
                    Some(_) => self.num_tokens(request)?,
                    None => num_tokens,
                };
                Some(max_cache_hit_length.unwrap_or(usize::MAX).min(limit).min(num_tokens.saturating_sub(1)))
            }
        };
        let hashes = self.hashes(request)?;
        let pool = self.pool.get();
        let events_enabled = pool.state.borrow(py)?.inner.events_enabled();
        let report = self.reports_hits(request, events_enabled)?;
        let inputs = if report { self.event_inputs(request, true)? } else { None };
        let hit = {
            let p = pool.state.borrow(py)?;
            let max_len = max_cache_hit_length.unwrap_or(num_tokens.saturating_sub(1));
            let content = self.lookup_content(request, &hashes, max_len)?;
            self.inner
                .get_computed_blocks(&p.inner, true, num_tokens, &hashes, max_cache_hit_length, content.as_ref(), true)
                .py_err()?
        };
        if hit.1 > 0 && report {
            let mut p = pool.state.borrow_mut(py)?;
            let coord = &mut self.inner.coord;
            p.tagged(request, inputs.as_ref(), |pool, tag| coord.emit_cached_block_events(pool, &hashes, &hit.0, tag))
                .py_err()?;
        }
        Ok(hit)
    }

    /// The per-group hit block ids of `new_computed_blocks` (None for None or the shared
    /// empty result: vLLM's identity test), with the generations a lookup recorded in them (None unless
    /// every group's ids came from `get_computed_blocks`).
    #[allow(clippy::type_complexity)]
    pub(super) fn hit_ids_and_generations(
        &self,
        py: Python<'_>,
        blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Option<Vec<Vec<u32>>>, Option<Vec<Vec<u32>>>)> {
        let Some(b) = blocks else { return Ok((None, None)) };
        if b.is_none() || self.empty.as_ref().is_some_and(|e| e.bind(py).is(b)) {
            return Ok((None, None));
        }
        let groups = match b.getattr(intern!(py, "_ids")) {
            Ok(g) if !g.is_none() => g,
            _ => {
                let blocks = b.getattr(intern!(py, "blocks")).map_err(|e| {
                    let ty = b.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                    let msg = format!("new_computed_blocks: expected KVCacheBlocks, got {ty}");
                    // vLLM reads `new_computed_blocks.blocks`: its AttributeError
                    if self.inner.caller.is_kvblock() || !e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) {
                        pyo3::exceptions::PyTypeError::new_err(msg)
                    } else {
                        pyo3::exceptions::PyAttributeError::new_err(msg)
                    }
                })?;
                if self.empty_blocks.as_ref().is_some_and(|e| e.bind(py).is(&blocks)) {
                    return Ok((None, None));
                }
                let mut out = Vec::new();
                for g in blocks.try_iter()? {
                    let g = g?;
                    let mut ids = Vec::with_capacity(g.len().unwrap_or(0));
                    for blk in g.try_iter()? {
                        let blk = blk?;
                        let id = match blk.getattr(intern!(py, "block_id")) {
                            Ok(i) => i,
                            Err(_) => blk,
                        };
                        ids.push(crate::py::args::uint32(&id, "new_computed_blocks")?);
                    }
                    out.push(ids);
                }
                return Ok((Some(out), None));
            }
        };
        let groups =
            groups.cast_into::<PyTuple>().map_err(|_| type_err("new_computed_blocks", "expected KVCacheBlocks"))?;
        let mut out = Vec::with_capacity(groups.len());
        let mut gens = Some(Vec::with_capacity(groups.len()));
        for g in groups.iter() {
            if let Ok(ids) = g.cast::<PyBlockIds>() {
                let ids = ids.get();
                out.push(ids.ids.clone());
                match (&mut gens, &ids.generations) {
                    (Some(v), Some(g)) => v.push(g.clone()),
                    _ => gens = None,
                }
            } else {
                out.push(block_ids_of(&g, "new_computed_blocks")?);
                gens = None;
            }
        }
        Ok((Some(out), gens))
    }
}
