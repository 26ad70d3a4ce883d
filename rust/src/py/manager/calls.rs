//! The scheduler's calls on `KVCacheManagerCore`: lookups, allocation (one request or a
//! batch), caching, freeing, retention pins.

use super::*;

/// `admit_batch`'s result: admitted, hit tokens, new block counts, hit ids, new ids.
type AdmitResult<'py> = (usize, Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>);

/// Per-group counts `[n, g]` as a numpy array (1-D when there is one group).
fn counts_array<'py>(py: Python<'py>, v: Vec<i32>, groups: usize) -> PyResult<Bound<'py, PyAny>> {
    let n = v.len().checked_div(groups).unwrap_or(0);
    let a = PyArray1::from_vec(py, v);
    if groups == 1 {
        Ok(a.into_any())
    } else {
        Ok(a.reshape([n, groups])?.into_any())
    }
}

#[pymethods]
impl PyManager {
    /// The number of request objects the no-op fast path remembers (for tests: freed
    /// requests are released).
    fn _slot_cache_len(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.state.borrow(py)?.slots.len())
    }

    /// The numbers of `allocate_slots` calls the block-boundary path answered, `(appending
    /// blocks, caching)` (for tests: that it runs, and only where it may).
    fn _boundary_calls(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let c = self.state.borrow(py)?.boundary_calls;
        Ok((c[0], c[1]))
    }

    /// `get_computed_blocks(request, max_cache_hit_length=None) -> (KVCacheBlocks,
    /// num_computed_tokens, shared_prefix_boundary)`: the longest prefix every group has
    /// cached, capped at `max_cache_hit_length` (default `request.num_tokens - 1`). No
    /// reference counts change. `(empty, 0, 0)` with caching off or
    /// `request.skip_reading_prefix_cache`.
    #[pyo3(signature = (request, max_cache_hit_length=None))]
    fn get_computed_blocks<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        max_cache_hit_length: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyAny>, usize, usize)> {
        let py = slf.py();
        let mut me = slf.get().state.borrow_mut(py)?;
        if me.make_blocks.is_none() {
            return Err(not_initialised());
        }
        let max_len = match max_cache_hit_length {
            Some(m) if !m.is_none() => {
                if me.inner.caller.is_kvblock() {
                    Some(crate::py::args::count(m, "max_cache_hit_length")?)
                } else if me.reads_cache(request)? {
                    Some(me.vllm_max_cache_hit_length(m)?)
                } else {
                    // vLLM returns the empty hit before reading it
                    Some(0)
                }
            }
            _ => None,
        };
        let num_tokens = match max_len {
            Some(_) => 0,
            None if !me.reads_cache(request)? => 0,
            // vLLM reads `request.num_tokens` only
            None if me.inner.vllm_caller() => me.num_tokens(request)?,
            None => me.view(request, false)?.num_tokens,
        };
        let (blocks, n, boundary) = me.lookup(request, num_tokens, max_len)?;
        let blocks = if me.inner.caller.is_kvblock() { me.hits_of(py, blocks)? } else { me.blocks_of(py, blocks)? };
        Ok((blocks, n, boundary))
    }

    /// `probe(request, max_cache_hit_length=None) -> num_cached_tokens`: the hit length
    /// `get_computed_blocks` would report, touching nothing: no LRU move, no reference count,
    /// no stats, no events (a "full" report-mode request included). For routers and
    /// schedulers scoring a waiting queue. 0 with caching off or
    /// `request.skip_reading_prefix_cache`.
    #[pyo3(signature = (request, max_cache_hit_length=None))]
    fn probe(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        max_cache_hit_length: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let me = self.state.borrow(py)?;
        let max_len = match max_cache_hit_length {
            Some(m) if !m.is_none() => Some(crate::py::args::count(m, "max_cache_hit_length")?),
            _ => None,
        };
        if !me.reads_cache(request)? {
            return Ok(0);
        }
        let num_tokens = me.view(request, false)?.num_tokens;
        let hashes = me.hashes(request)?;
        let p = me.pool.get().state.borrow(py)?;
        let content = me.lookup_content(request, &hashes, max_len.unwrap_or(num_tokens.saturating_sub(1)))?;
        let (_, n, _) = me
            .inner
            .get_computed_blocks(&p.inner, true, num_tokens, &hashes, max_len, content.as_ref(), false)
            .py_err()?;
        Ok(n)
    }

    /// Pin the cached blocks of the prefix with these full-block hashes (see
    /// `kvblock.KVCacheManager.pin_prefix`); returns the pinned tokens.
    #[pyo3(signature = (block_hashes, ttl_s=None))]
    fn _pin_prefix(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        ttl_s: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let ttl = match ttl_s {
            Some(t) => crate::py::retention::duration_of(t, "ttl_s")?,
            None => None,
        };
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        hashes.check(0, hashes.0.len())?;
        let mut guard = self.state.borrow_mut(py)?;
        let me = &mut *guard;
        if !me.inner.enable_caching {
            return Err(value_err("prefix", "prefix caching is off: nothing is cached to pin"));
        }
        if hashes.0.is_empty() {
            return Err(value_err("prefix", "holds no full block: nothing to pin"));
        }
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let now = crate::py::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        let expires_at = match ttl {
            Some(t) => Some(
                match now {
                    Some(n) => n,
                    None => crate::py::retention::read_clock(py, me.clock.as_ref())?,
                } + t,
            ),
            None => None,
        };
        let h = me.inner.coord.hash_block_size;
        me.inner.retention.pin(&me.inner.coord, &mut p.inner, &hashes, h, expires_at).py_err()
    }

    /// Unpin the prefix with these full-block hashes; returns the tokens it held.
    fn _unpin_prefix(&self, py: Python<'_>, block_hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        if hashes.0.is_empty() {
            return Err(value_err("prefix", "holds no full block: it is not pinned"));
        }
        hashes.check(0, hashes.0.len())?;
        let key = crate::hashing::source::HashSource::digest(&hashes, hashes.0.len() - 1).py_err()?;
        let mut guard = self.state.borrow_mut(py)?;
        let me = &mut *guard;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        if !me.inner.retention.pins.contains_key(&key) {
            return Err(value_err("prefix", "is not pinned"));
        }
        crate::py::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        if !me.inner.retention.pins.contains_key(&key) {
            return Err(value_err("prefix", "is not pinned (its TTL ran out)"));
        }
        me.inner.retention.unpin(&mut p.inner, &key).py_err()
    }

    /// The pinned prefixes: `[(last block hash, pinned tokens, block ids, expires_at|None)]`,
    /// sorted by hash.
    #[allow(clippy::type_complexity)]
    fn _pins<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Bound<'py, pyo3::types::PyBytes>, usize, Vec<u32>, Option<f64>)>> {
        let me = self.state.borrow(py)?;
        let mut v: Vec<_> = me.inner.retention.pins.iter().collect();
        v.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        Ok(v.into_iter()
            .map(|(k, p)| (pyo3::types::PyBytes::new(py, k.as_bytes()), p.num_tokens, p.blocks.clone(), p.expires_at))
            .collect())
    }

    /// Distinct blocks pins hold, and the cap.
    #[getter]
    fn _pinned_blocks(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        self.state.with(py, |me| (me.inner.retention.num_pinned_blocks(), me.inner.retention.max_pinned_blocks))
    }

    /// Read the clock now: priorities that ran out decay, TTL pins that expired are unpinned.
    fn tick(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self.state.borrow_mut(py)?;
        let me = &mut *guard;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        crate::py::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        Ok(())
    }

    /// The coordinator's `find_longest_cache_hit(block_hashes, max_cache_hit_length)`: (hit
    /// block ids per group, hit length, uncached common prefix tokens).
    fn _find_longest_cache_hit(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        max_cache_hit_length: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<Vec<u32>>, usize, usize)> {
        let me = self.state.borrow(py)?;
        me.hashes_only_lookup("find_longest_cache_hit")?;
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        let max_len = crate::py::args::count(max_cache_hit_length, "max_cache_hit_length")?;
        let p = me.pool.get().state.borrow(py)?;
        me.inner.coord.find_longest_cache_hit(&p.inner, &hashes, max_len, None).py_err()
    }

    /// The coordinator's `find_longest_cache_hit_per_group`: (blocks per group, hit length
    /// per group).
    fn _find_longest_cache_hit_per_group(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        max_cache_hit_length: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<Vec<u32>>, Vec<usize>)> {
        let me = self.state.borrow(py)?;
        me.hashes_only_lookup("find_longest_cache_hit_per_group")?;
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        let max_len = crate::py::args::count(max_cache_hit_length, "max_cache_hit_length")?;
        let p = me.pool.get().state.borrow(py)?;
        me.inner.coord.find_longest_cache_hit_per_group(&p.inner, &hashes, max_len).py_err()
    }

    /// Group `group`'s manager's `find_longest_cache_hit` (vLLM's classmethod, the group's
    /// spec): (blocks per listed group, hit length).
    #[pyo3(signature = (group, block_hashes, max_length, kv_cache_group_ids, drop_eagle_block, alignment_tokens))]
    #[allow(clippy::too_many_arguments)]
    fn _group_find_longest_cache_hit(
        &self,
        py: Python<'_>,
        group: usize,
        block_hashes: &Bound<'_, PyAny>,
        max_length: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::py::args::kv_cache_group_ids)] kv_cache_group_ids: Vec<u32>,
        drop_eagle_block: bool,
        alignment_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<Vec<u32>>, usize)> {
        let me = self.state.borrow(py)?;
        me.hashes_only_lookup("find_longest_cache_hit")?;
        let m = me.inner.coord.managers.get(group).ok_or_else(|| value_err("group", "out of range"))?;
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        let p = me.pool.get().state.borrow(py)?;
        let q = crate::manager::group_state::HitQuery {
            hashes: &hashes,
            max_length: crate::py::args::count(max_length, "max_length")?,
            group_ids: &kv_cache_group_ids,
            drop_eagle_block,
            alignment_tokens: crate::py::args::count(alignment_tokens, "alignment_tokens")?.max(1),
            past_hashes_is_error: me.inner.vllm_caller(),
            verify: None,
        };
        m.find_longest_cache_hit(&p.inner, &q).py_err()
    }

    /// vLLM 0.33.0's `allocate_slots` (spec §5.3). Returns the newly allocated blocks
    /// (`KVCacheBlocks`, the shared empty one if none), or None if the pool cannot supply them
    /// (only the frees of blocks outside the attention window, which vLLM makes first, have
    /// happened). Slots are capped at `max_model_len` tokens, as in vLLM.
    ///
    /// Raises, changing nothing: `TypeError` / `ValueError` for a bool, non-int or negative
    /// count (named), `ValueError` for `num_new_tokens == 0` with nothing to adopt, for hit
    /// blocks of another shape than the manager's groups or not in the pool, and (vLLM's
    /// error, without vLLM's leak) when external tokens need more blocks than are free;
    /// `TypeError` / `ValueError` for a malformed `request.block_hashes` entry the call would
    /// read; `AssertionError` where vLLM asserts (hit blocks for a running request). On
    /// kvblock's own API (not vLLM's, which allocates it a new table), `ValueError` for a
    /// request this manager holds no table for that has computed tokens (freed) or is
    /// finished: its KV is gone.
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=false, num_encoder_tokens=0, full_sequence_must_fit=false, reserved_blocks=0, has_scheduled_reqs=true, skip_zeroing_group_ids=None))]
    #[pyo3(
        text_signature = "($self, /, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0, has_scheduled_reqs=True, skip_zeroing_group_ids=())"
    )]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = crate::py::args::num_new_tokens)] num_new_tokens: i64,
        #[pyo3(from_py_with = crate::py::args::num_new_computed_tokens)] num_new_computed_tokens: i64,
        new_computed_blocks: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = crate::py::args::num_lookahead_tokens)] num_lookahead_tokens: i64,
        #[pyo3(from_py_with = crate::py::args::num_external_computed_tokens)] num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        #[pyo3(from_py_with = crate::py::args::num_encoder_tokens)] num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        #[pyo3(from_py_with = crate::py::args::reserved_blocks)] reserved_blocks: i64,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        if me.make_blocks.is_none() {
            // checked first: the result could not be built after the allocation
            return Err(not_initialised());
        }
        let num_new_tokens = count(num_new_tokens, "num_new_tokens")?;
        let num_new_computed_tokens = count(num_new_computed_tokens, "num_new_computed_tokens")?;
        let num_external_computed_tokens = count(num_external_computed_tokens, "num_external_computed_tokens")?;
        nothing_to_allocate_check(num_new_tokens, num_new_computed_tokens, num_external_computed_tokens)?;
        let (hits, gens) = me.hit_ids_and_generations(py, new_computed_blocks)?;
        let gens = if me.inner.caller.is_kvblock() { gens } else { None };
        let skip: Vec<u32> = match skip_zeroing_group_ids {
            Some(s) if !s.is_none() && me.inner.caller.is_kvblock() => {
                crate::py::args::uint32_seq(s, "skip_zeroing_group_ids")?
            }
            // vLLM asks `i in skip_zeroing_group_ids` of each group, only when allocating
            // external blocks
            Some(s) if !s.is_none() && num_external_computed_tokens > 0 => {
                let mut skip = Vec::new();
                for g in 0..me.inner.coord.num_groups() as u32 {
                    if s.contains(g)? {
                        skip.push(g);
                    }
                }
                skip
            }
            _ => Vec::new(),
        };
        let args = AllocArgs {
            num_new_tokens,
            num_new_computed_tokens,
            new_computed: hits.as_deref(),
            num_lookahead_tokens: count(num_lookahead_tokens, "num_lookahead_tokens")?,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens: count(num_encoder_tokens, "num_encoder_tokens")?,
            full_sequence_must_fit,
            reserved_blocks: count(reserved_blocks, "reserved_blocks")?,
            has_scheduled_reqs,
            skip_zeroing_group_ids: &skip,
            new_computed_generations: gens.as_deref(),
        };
        me.allocate(py, request, &args, hits.is_some())
    }

    /// Admit new requests in order, each exactly as `get_computed_blocks(r)` followed by
    /// `allocate_slots(r, r.num_tokens - hit, hit, hit_blocks, num_lookahead_tokens)` would;
    /// stops at the first request the pool cannot take (it, and those after it, are left
    /// untouched). Returns `(num_admitted, hit_tokens, num_new_blocks, hit_block_ids,
    /// new_block_ids)`: `hit_tokens` int32 `[admitted]`; `num_new_blocks` int32 `[admitted]`
    /// for one KV-cache group, `[admitted, groups]` for several; and the hit and new block ids
    /// of all admitted requests concatenated (request by request, group by group).
    /// Prefix-cache stats are the caller's to record (`record_prefix_cache_stats`).
    ///
    /// Every request must be waiting: unknown to this manager, listed once, not finished,
    /// with `num_computed_tokens == 0` and at least one token. All requests are checked (these
    /// rules, their fields and every block hash) before any is admitted, so a `ValueError` or
    /// `TypeError` leaves the manager and pool unchanged.
    #[pyo3(signature = (requests, num_lookahead_tokens=0, has_scheduled_reqs=true))]
    fn admit_batch<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = crate::py::args::num_lookahead_tokens)] num_lookahead_tokens: i64,
        has_scheduled_reqs: bool,
    ) -> PyResult<AdmitResult<'py>> {
        let py = slf.py();
        let reqs = requests.cast::<PyList>().map_err(|_| type_err("requests", "expected a list of requests"))?;
        let lookahead = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        // Phase 1: read and check every request; nothing changes until all pass. Everything
        // phase 2 needs from a request is read here (under a shared borrow: a request
        // property may read the manager, not change it), so no request code runs once
        // admissions have begun.
        let (groups, checked) = {
            let me = slf.get().state.borrow(py)?;
            if me.make_blocks.is_none() {
                return Err(not_initialised());
            }
            let groups = me.inner.coord.num_groups();
            let events_enabled = me.pool.get().state.borrow(py)?.inner.events_enabled();
            let mut checked = Vec::with_capacity(reqs.len());
            let mut seen = hashbrown::HashSet::with_capacity(reqs.len());
            for r in reqs.iter() {
                let v = me.view(&r, has_scheduled_reqs)?;
                let id = request_id_str(&v.id)?.to_owned();
                if me.inner.holds_blocks(&id) {
                    return Err(value_err("requests", format!("request {id:?} already holds blocks in this manager")));
                }
                if v.num_tokens == 0 {
                    return Err(value_err("requests", format!("request {id:?} has no tokens to admit")));
                }
                if v.num_computed != 0 {
                    return Err(value_err(
                        "requests",
                        format!(
                            "request {id:?} is not waiting: {} of {} tokens computed",
                            v.num_computed, v.num_tokens
                        ),
                    ));
                }
                if me.inner.caller.is_kvblock() && v.num_tokens > me.inner.max_model_len {
                    return Err(value_err(
                        "requests",
                        format!(
                            "request {id:?}: {} tokens exceed max_model_len {}",
                            v.num_tokens, me.inner.max_model_len
                        ),
                    ));
                }
                if !seen.insert(id) {
                    return Err(value_err("requests", format!("request {:?} is listed twice", request_id_str(&v.id)?)));
                }
                // a finished request gets no blocks (kvblock's own API)
                me.check_new_request(&r, &v)?;
                let reads = me.reads_cache(&r)?;
                let hashes = if me.inner.enable_caching { me.hashes(&r)? } else { PyHashes::empty(py) };
                hashes.check(0, v.num_tokens / me.inner.coord.hash_block_size)?;
                let report = reads && me.reports_hits(&r, events_enabled)?;
                let events = me.event_inputs(&r, events_enabled)?;
                let ret = me.new_request_retention(&r, &v)?;
                let content = me.content(&r, 0, v.num_tokens / me.inner.coord.hash_block_size)?;
                checked.push((r, v, reads, hashes, report, events, ret, content));
            }
            (groups, checked)
        };
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        // Phase 2: admit in order.
        let (mut hit_tokens, mut new_counts, mut hit_ids, mut new_ids) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut admitted = 0;
        let pool = me.pool.bind(py).clone();
        {
            let mut p = pool.get().state.borrow_mut(py)?;
            crate::py::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        }
        for (r, v, reads, hashes, report, events, ret, content) in &checked {
            let mut p = pool.get().state.borrow_mut(py)?;
            let (hit, n, _) = if *reads {
                me.inner
                    .get_computed_blocks(&p.inner, true, v.num_tokens, hashes, None, content.as_ref(), true)
                    .py_err()?
            } else {
                (vec![Vec::new(); groups], 0, 0)
            };
            if n > 0 && *report {
                let coord = &mut me.inner.coord;
                p.tagged(r, events.as_ref(), |pool, tag| coord.emit_cached_block_events(pool, hashes, &hit, tag))
                    .py_err()?;
            }
            let has_hit = hit.iter().any(|g| !g.is_empty());
            let args = AllocArgs {
                num_new_tokens: v.num_tokens - n,
                num_new_computed_tokens: n,
                new_computed: if has_hit { Some(&hit) } else { None },
                num_lookahead_tokens: lookahead,
                has_scheduled_reqs,
                ..Default::default()
            };
            let res = tagged_call(&mut me.inner, &mut p, r, events.as_ref(), v, content.as_ref(), |m, pool, view| {
                m.allocate_slots(pool, view, hashes, &args)
            })?;
            match res {
                None => break,
                Some(new) => {
                    if let Some(ret) = ret {
                        me.inner.retention.requests.insert(request_id_str(&v.id)?.to_owned(), ret.clone());
                    }
                    hit_tokens.push(n as i32);
                    new_counts.extend(new.iter().map(|g| g.len() as i32));
                    for g in hit {
                        hit_ids.extend(g);
                    }
                    for g in new {
                        new_ids.extend(g);
                    }
                    admitted += 1;
                }
            }
        }
        Ok((
            admitted,
            PyArray1::from_vec(py, hit_tokens).into_any(),
            counts_array(py, new_counts, groups)?,
            ids_array(py, hit_ids).into_any(),
            ids_array(py, new_ids).into_any(),
        ))
    }

    /// Allocate slots for a whole step of running requests in one call: for each request,
    /// exactly what `allocate_slots(request, num_new_tokens[i], num_lookahead_tokens=...)`
    /// does, in order. Returns `(num_new_blocks, new_block_ids)`: int32 `[len(requests)]`
    /// (`[len(requests), groups]` for several groups; -1 where the pool could not supply the
    /// blocks, as `allocate_slots` returning None) and the new block ids of all requests
    /// concatenated, int32. Every request and argument is checked (fields, counts, listed
    /// once, the hashes it would cache; on kvblock's own API, that a request this manager
    /// holds no table for has no computed tokens and is not finished) before any change: a
    /// `ValueError` / `TypeError` leaves the whole batch undone.
    #[pyo3(signature = (requests, num_new_tokens=None, num_lookahead_tokens=0))]
    fn allocate_slots_batch<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyAny>,
        num_new_tokens: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = crate::py::args::num_lookahead_tokens)] num_lookahead_tokens: i64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let py = slf.py();
        let reqs = requests.cast::<PyList>().map_err(|_| type_err("requests", "expected a list of requests"))?;
        let n = reqs.len();
        let new_tokens: Vec<usize> = match num_new_tokens {
            None => vec![1; n],
            Some(x) if x.is_instance_of::<pyo3::types::PyInt>() => {
                vec![count(crate::py::args::num_new_tokens(x)?, "num_new_tokens")?; n]
            }
            Some(x) => {
                let v = crate::py::convert::extract_tokens(x, "num_new_tokens", 0)?;
                let v: Vec<Option<i64>> = crate::with_token_slice!(&v, |s| s
                    .iter()
                    .map(|&t| crate::hashing::value::TokenId::as_i64(t).ok())
                    .collect());
                if v.len() != n {
                    return Err(value_err("num_new_tokens", format!("{} values for {n} requests", v.len())));
                }
                v.iter()
                    .enumerate()
                    .map(|(i, &t)| {
                        let arg = format!("num_new_tokens[{i}]");
                        count(t.ok_or_else(|| value_err(&arg, "out of range (must fit in int64)"))?, &arg)
                    })
                    .collect::<PyResult<Vec<usize>>>()?
            }
        };
        let lookahead = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        let args_of = |i: usize| AllocArgs {
            num_new_tokens: new_tokens[i],
            num_lookahead_tokens: lookahead,
            has_scheduled_reqs: true,
            ..Default::default()
        };
        // Phase 1 (under a shared borrow): read and check every request.
        let (groups, checked) = {
            let me = slf.get().state.borrow(py)?;
            let groups = me.inner.coord.num_groups();
            let events_enabled = me.pool.get().state.borrow(py)?.inner.events_enabled();
            let mut seen = hashbrown::HashSet::with_capacity(n);
            let mut checked = Vec::with_capacity(n);
            for (i, r) in reqs.iter().enumerate() {
                let v = me.view(&r, true)?;
                let id = request_id_str(&v.id)?;
                if !seen.insert(id.to_owned()) {
                    return Err(value_err("requests", format!("request {id:?} is listed twice")));
                }
                if new_tokens[i] == 0 {
                    return Err(value_err(
                        &format!("num_new_tokens[{i}]"),
                        "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
                    ));
                }
                if me.inner.caller.is_kvblock() && v.num_tokens > me.inner.max_model_len {
                    return Err(value_err(
                        "requests",
                        format!(
                            "request {id:?}: {} tokens exceed max_model_len {}",
                            v.num_tokens, me.inner.max_model_len
                        ),
                    ));
                }
                if me.inner.coord.slot(id).is_none() {
                    me.check_new_request(&r, &v)?;
                }
                let hashes = if me.inner.enable_caching { me.hashes(&r)? } else { PyHashes::empty(py) };
                let (lo, hi) = me.inner.cache_read_range(&v.as_view(0)?, Some(&args_of(i)), hashes.0.len());
                hashes.check(lo, hi)?;
                let events = me.event_inputs(&r, events_enabled)?;
                let content = me.content(&r, lo, hi)?;
                checked.push((r, v, hashes, events, content));
            }
            (groups, checked)
        };
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        let pool = me.pool.bind(py).clone();
        let mut counts = Vec::with_capacity(n * groups);
        let mut all = Vec::new();
        let mut p = pool.get().state.borrow_mut(py)?;
        crate::py::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        for (i, (r, v, hashes, events, content)) in checked.iter().enumerate() {
            let args = args_of(i);
            let res = tagged_call(&mut me.inner, &mut p, r, events.as_ref(), v, content.as_ref(), |m, pool, view| {
                m.allocate_slots(pool, view, hashes, &args)
            })?;
            match res {
                None => counts.extend(std::iter::repeat_n(-1, groups)),
                Some(new) => {
                    for g in new {
                        counts.push(g.len() as i32);
                        all.extend(g);
                    }
                }
            }
        }
        Ok((counts_array(py, counts, groups)?, ids_array(py, all).into_any()))
    }

    /// `free(request)`: release the request's blocks, each group tail first. Unknown or
    /// already-freed requests are a no-op (as in vLLM).
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let (id, hisparse) = {
            let mut me = slf.get().state.borrow_mut(py)?;
            let id = me.id_of(request)?;
            me.slots.remove(request);
            (id, me.inner.coord.hisparse().is_some())
        };
        // HiSparse's coordinator keeps a finished request's pending publication
        // (`request.is_finished()`); other managers never read it
        let finished = if hisparse { request.call_method0(Field::IsFinished.interned(py))?.is_truthy()? } else { true };
        Self::free_by_id(slf, id.as_any(), finished)
    }

    /// `free` by request id.
    fn free_request_id(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        Self::free_by_id(slf, request_id, true)
    }
}

impl PyManager {
    /// `free` by request id, `finished` as `request.is_finished()`.
    fn free_by_id(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>, finished: bool) -> PyResult<()> {
        let py = slf.py();
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        // vLLM pops the id from its tables: another object is an id no request has
        let Some(request_id) = id_arg(request_id, me.inner.vllm_caller())? else { return Ok(()) };
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        crate::py::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        me.inner.free_request(&mut p.inner, request_id, finished).py_err()
    }
}

#[pymethods]
impl PyManager {
    /// `pop_blocks_for_free(request)`: the request's block ids (every group, allocation order),
    /// the request forgotten; the caller frees them (reversed).
    fn _pop_blocks_for_free(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let mut me = self.state.borrow_mut(py)?;
        let id = me.id_of(request)?;
        me.slots.remove(request);
        me.inner.coord.pop_blocks_for_free(request_id_str(&id)?).py_err()
    }

    /// `cache_blocks(request, num_computed_tokens)`: cache the request's full blocks up to
    /// that many tokens (no-op with caching off).
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::py::args::num_computed_tokens)] num_computed_tokens: i64,
    ) -> PyResult<()> {
        let py = slf.py();
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        slf.get().state.borrow_mut(py)?.cache(py, request, n)
    }

    /// `remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens=None)`:
    /// free blocks that left the attention window, in every group.
    #[pyo3(signature = (request_id, processed_computed_tokens, num_prompt_tokens=None))]
    fn remove_skipped_blocks(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        processed_computed_tokens: &Bound<'_, PyAny>,
        num_prompt_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let vllm = me.inner.vllm_caller();
        if vllm && me.never_skips() {
            return Ok(());
        }
        let arg = "processed_computed_tokens";
        let n = if vllm {
            crate::py::args::vllm_count(processed_computed_tokens, arg)?
        } else {
            crate::py::args::count(processed_computed_tokens, arg)?
        };
        let prompt = match num_prompt_tokens {
            Some(p) if !p.is_none() && vllm => Some(crate::py::args::vllm_count(p, "num_prompt_tokens")?),
            Some(p) if !p.is_none() => Some(crate::py::args::count(p, "num_prompt_tokens")?),
            _ => None,
        };
        // vLLM would key a new table entry by another object: refused (kvblock keys by str)
        let request_id = id_arg(request_id, false)?.unwrap_or_default();
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner.remove_skipped_blocks(&mut p.inner, request_id, n, prompt).py_err()
    }
}
