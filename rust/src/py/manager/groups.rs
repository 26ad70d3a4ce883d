//! The per-group views of `KVCacheManagerCore`: what vLLM's coordinator and single-type
//! managers read and write (tables, cached counts, Mamba state, pending copies), the
//! step's new block ids and events, and the coordinator's description.

use super::*;

#[pymethods]
impl PyManager {
    /// The coordinator's `get_num_blocks_to_allocate` (may be negative, as vLLM's).
    #[pyo3(signature = (request_id, num_tokens, new_computed_blocks, num_encoder_tokens, total_computed_tokens, num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=false, prefill_end=0))]
    #[allow(clippy::too_many_arguments)]
    fn _get_num_blocks_to_allocate(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyString>,
        num_tokens: usize,
        new_computed_blocks: Vec<Vec<u32>>,
        num_encoder_tokens: usize,
        total_computed_tokens: usize,
        num_local_computed_tokens: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
        prefill_end: usize,
    ) -> PyResult<i64> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        let pool = me.pool.bind(py).clone();
        let p = pool.get().state.borrow(py)?;
        p.inner.check_ids(&new_computed_blocks.concat()).py_err()?;
        let nc: Vec<&[u32]> = new_computed_blocks.iter().map(|g| g.as_slice()).collect();
        me.inner
            .coord
            .in_request_slot(request_id, |coord, slot| {
                coord.get_num_blocks_to_allocate(
                    &p.inner,
                    slot,
                    request_id,
                    num_tokens,
                    &nc,
                    num_encoder_tokens,
                    total_computed_tokens,
                    num_local_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                    prefill_end,
                )
            })
            .py_err()
    }

    /// Group `group`'s `get_num_blocks_to_allocate`.
    #[pyo3(signature = (group, request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=false, prefill_end=0))]
    #[allow(clippy::too_many_arguments)]
    fn _group_get_num_blocks_to_allocate(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        num_tokens: usize,
        new_computed_blocks: Vec<u32>,
        total_computed_tokens: usize,
        num_local_computed_tokens: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
        prefill_end: usize,
    ) -> PyResult<i64> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        me.check_group(group)?;
        let pool = me.pool.bind(py).clone();
        let p = pool.get().state.borrow(py)?;
        me.inner.coord.pool_of(group, &p.inner).check_ids(&new_computed_blocks).py_err()?;
        me.inner
            .coord
            .in_request_slot(request_id, |coord, slot| {
                if coord.managers[group].cfg.spec.kind.is_hisparse() {
                    // HiSparse's kinds: their rules (the source group's on the host pool: 0,
                    // or the admission sentinel when the host pool cannot back the request)
                    return coord
                        .hisparse_num_blocks(
                            &p.inner,
                            group,
                            slot,
                            request_id,
                            num_tokens,
                            &new_computed_blocks,
                            total_computed_tokens,
                            num_local_computed_tokens,
                            apply_admission_cap,
                        )
                        .map(|n| n as i64);
                }
                coord.managers[group].get_num_blocks_to_allocate(
                    &p.inner,
                    slot,
                    num_tokens,
                    &new_computed_blocks,
                    total_computed_tokens,
                    num_local_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                    prefill_end,
                )
            })
            .py_err()
    }

    /// Group `group`'s `allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)`.
    /// `ValueError` when the group's pool (the host pool for HiSparse's source group) has
    /// fewer free blocks than the call takes, changing nothing.
    fn _group_allocate_new_blocks(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        num_tokens: usize,
        num_tokens_main_model: usize,
    ) -> PyResult<Vec<u32>> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        me.check_group(group)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner
            .coord
            .in_request_slot(request_id, |coord, slot| {
                let kind = coord.managers[group].cfg.spec.kind;
                // checked against the group's pool first, so nothing changes on error; the
                // HiSparse resident and hot rules take their blocks before changing anything
                let need = if kind.is_hisparse() && kind != Kind::HiSparseSource {
                    0
                } else {
                    coord.managers[group].new_blocks_needed(slot, num_tokens, num_tokens_main_model)
                };
                let free = coord.pool_of(group, &p.inner).num_free_blocks();
                if need > free {
                    return Err(crate::error::Error::NotEnoughFreeBlocks { requested: need, free });
                }
                if kind.is_hisparse() {
                    // HiSparse's kinds: the source group's blocks and copy-on-write from the
                    // host pool
                    return coord.hisparse_allocate_new(
                        &mut p.inner,
                        group,
                        slot,
                        request_id,
                        num_tokens,
                        num_tokens_main_model,
                    );
                }
                coord.managers[group].allocate_new_blocks(
                    &mut p.inner,
                    slot,
                    request_id,
                    num_tokens,
                    num_tokens_main_model,
                )
            })
            .py_err()
    }

    /// Group `group`'s `remove_skipped_blocks`.
    #[pyo3(signature = (group, request_id, processed_computed_tokens, num_prompt_tokens=None))]
    fn _group_remove_skipped_blocks(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> PyResult<()> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        me.check_group(group)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner
            .coord
            .in_request_slot(request_id, |coord, slot| {
                coord.managers[group].remove_skipped_blocks(
                    &mut p.inner,
                    slot,
                    processed_computed_tokens,
                    num_prompt_tokens,
                )
            })
            .py_err()
    }

    /// Group `group`'s `free(request_id)`.
    fn _group_free(&self, py: Python<'_>, group: usize, request_id: &Bound<'_, PyString>) -> PyResult<()> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        me.check_group(group)?;
        if me.inner.coord.slot(request_id).is_none() {
            return Ok(());
        }
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner
            .coord
            .in_request_slot(request_id, |coord, slot| {
                if coord.managers[group].cfg.spec.kind.is_hisparse() {
                    // HiSparse's kinds: the coordinator's `free(request_id)` (source and
                    // resident groups; vLLM's stored request is not at hand: finished), then
                    // the group's pool
                    return coord.hisparse_free(&mut p.inner, group, slot, request_id, true);
                }
                coord.managers[group].free(&mut p.inner, slot, request_id)
            })
            .py_err()
    }

    /// The request's block ids per group, in table order (empty lists if unknown).
    fn _block_ids(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        let me = self.state.borrow(py)?;
        me.block_ids(request_id)
    }

    /// vLLM's `get_blocks(request_id)`: the request's blocks per group as the manager's
    /// `KVCacheBlocks` (block ids held in Rust; the shared empty one if it holds none, or
    /// for an unknown request).
    fn get_blocks<'py>(&self, py: Python<'py>, request_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let me = self.state.borrow(py)?;
        let groups = me.block_ids(request_id)?;
        me.blocks_of(py, groups)
    }

    /// Group `group`'s `req_to_blocks[request_id]` (None if the key is absent).
    fn _group_table(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
    ) -> PyResult<Option<Vec<u32>>> {
        let request_id = request_id_str(request_id)?;
        self.state.with(py, |me| {
            let slot = me.inner.coord.slot(request_id)?;
            let r = me.inner.coord.managers.get(group)?.req(slot)?;
            r.present.then(|| r.blocks.clone())
        })
    }

    /// `req_to_blocks[request_id] = block_ids` in group `group` (vLLM code and tests writing
    /// a table directly; reference counts are theirs to keep).
    fn _group_set_table(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        block_ids: Vec<u32>,
    ) -> PyResult<()> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        me.check_group(group)?;
        me.pool.get().state.borrow(py)?.inner.check_ids(&block_ids).py_err()?;
        let slot = me.inner.coord.slot_or_insert(request_id);
        let r = &mut me.inner.coord.managers[group].reqs[slot];
        r.present = true;
        r.blocks = block_ids;
        Ok(())
    }

    /// `del req_to_blocks[request_id]` in group `group`.
    fn _group_del_table(&self, py: Python<'_>, group: usize, request_id: &Bound<'_, PyString>) -> PyResult<bool> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        let Some(slot) = me.inner.coord.slot(request_id) else { return Ok(false) };
        let Some(m) = me.inner.coord.managers.get_mut(group) else { return Err(value_err("group", "out of range")) };
        let r = &mut m.reqs[slot];
        let was = r.present;
        r.present = false;
        r.blocks.clear();
        me.inner.coord.release_if_vacant(request_id);
        Ok(was)
    }

    /// The request ids with an entry in group `group`'s `req_to_blocks`.
    fn _group_request_ids(&self, py: Python<'_>, group: usize) -> PyResult<Vec<String>> {
        self.state.with(py, |me| {
            let coord = &me.inner.coord;
            let Some(m) = coord.managers.get(group) else { return Vec::new() };
            coord
                .request_ids()
                .into_iter()
                .filter(|id| coord.slot(id).and_then(|s| m.req(s)).is_some_and(|r| r.present))
                .collect()
        })
    }

    /// Group `group`'s `num_cached_block` as `{request_id: count}`.
    fn _group_num_cached(&self, py: Python<'_>, group: usize) -> PyResult<Vec<(String, usize)>> {
        self.state.with(py, |me| {
            let coord = &me.inner.coord;
            let Some(m) = coord.managers.get(group) else { return Vec::new() };
            coord
                .request_ids()
                .into_iter()
                .filter_map(|id| {
                    let n = coord.slot(&id).and_then(|s| m.req(s)).and_then(|r| r.num_cached)?;
                    Some((id, n))
                })
                .collect()
        })
    }

    /// Group `group`'s Mamba "align" bookkeeping of a request: `(last_state_block_idx,
    /// num_retired_blocks, allocated, checkpoint, partial_hit)`.
    #[allow(clippy::type_complexity)]
    fn _group_mamba_state(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
    ) -> PyResult<Option<(Option<i64>, Option<usize>, bool, Option<(usize, usize)>, Option<(u32, u32)>)>> {
        let request_id = request_id_str(request_id)?;
        self.state.with(py, |me| {
            let slot = me.inner.coord.slot(request_id)?;
            let r = me.inner.coord.managers.get(group)?.req(slot)?;
            Some((r.last_state_block_idx, r.num_retired, r.allocated, r.checkpoint, r.partial_hit))
        })
    }

    /// Group `group`'s per-request state, for every request that has any there:
    /// `(request_id, last_state_block_idx, num_retired_blocks, allocated, checkpoint,
    /// partial_hit, producer_partial_tail)` (vLLM's `last_state_block_idx`,
    /// `_num_retired_blocks`, `_allocated_block_reqs`, `_checkpoints`, `_partial_hit_reqs`,
    /// `_producer_partial_tail_reqs`); empty for a group the manager lacks.
    #[allow(clippy::type_complexity)]
    fn _group_request_states(
        &self,
        py: Python<'_>,
        group: usize,
    ) -> PyResult<
        Vec<(
            String,
            Option<i64>,
            Option<usize>,
            bool,
            Option<(usize, usize)>,
            Option<(u32, u32)>,
            Option<(u32, usize)>,
        )>,
    > {
        self.state.with(py, |me| {
            let coord = &me.inner.coord;
            let Some(m) = coord.managers.get(group) else { return Vec::new() };
            coord
                .request_ids()
                .into_iter()
                .filter_map(|id| {
                    let r = coord.slot(&id).and_then(|s| m.req(s))?;
                    Some((
                        id,
                        r.last_state_block_idx,
                        r.num_retired,
                        r.allocated,
                        r.checkpoint,
                        r.partial_hit,
                        r.producer_tail,
                    ))
                })
                .collect()
        })
    }

    /// Set (`Some((block index, source block id))`) or clear (`None`) group `group`'s
    /// `_partial_hit_reqs[request_id]`: the tail a partial hit will replace by a private copy
    /// at the request's next allocation. `ValueError` for a group out of range or a block
    /// not in the pool, changing nothing.
    fn _group_set_partial_hit(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        value: Option<(u32, u32)>,
    ) -> PyResult<()> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        me.check_group(group)?;
        if let Some((_, b)) = value {
            let pool = me.pool.bind(py).clone();
            pool.get().state.borrow(py)?.inner.check_ids(&[b]).py_err()?;
        }
        if value.is_none() && me.inner.coord.slot(request_id).is_none() {
            return Ok(());
        }
        me.inner.coord.in_request_slot(request_id, |coord, slot| {
            let m = &mut coord.managers[group];
            m.ensure_slot(slot);
            m.reqs[slot].partial_hit = value;
        });
        Ok(())
    }

    /// Group `group`'s pending copy-on-write `(source, copy)` block id pairs (vLLM's
    /// `_pending_cow_copies`), drained with `take` (`take_pending_cow_copies`).
    fn _group_pending_cow_copies(&self, py: Python<'_>, group: usize, take: bool) -> PyResult<Vec<(u32, u32)>> {
        let mut me = self.state.borrow_mut(py)?;
        let host_group = me.inner.coord.hisparse().map(|t| t.host_group());
        let Some(m) = me.inner.coord.managers.get_mut(group) else { return Ok(Vec::new()) };
        if take && host_group == Some(group) {
            // vLLM's `HiSparseSourceManager.take_pending_cow_copies()`: host copies never
            // reach the worker's device copy path (`take_host_cow_copies` drains them)
            return Ok(Vec::new());
        }
        Ok(if take { m.take_pending_cow_copies() } else { m.st.pending_cow.clone() })
    }

    /// Group `group`'s pending boundary-state hand-offs `(request_id, group, block id,
    /// boundary tokens)` (vLLM's `_pending_boundary_state_offloads`), drained with `take`
    /// (`take_pending_boundary_state_offloads`).
    fn _group_pending_offloads(
        &self,
        py: Python<'_>,
        group: usize,
        take: bool,
    ) -> PyResult<Vec<(String, u32, u32, usize)>> {
        let mut me = self.state.borrow_mut(py)?;
        let Some(m) = me.inner.coord.managers.get_mut(group) else { return Ok(Vec::new()) };
        Ok(if take { m.take_pending_offloads() } else { m.st.pending_offloads.clone() })
    }

    /// Group `group`'s `finalize_partial_tail_offload(request_id, num_computed_tokens,
    /// num_in_flight_tokens)`: `(group, block id, boundary tokens)` or None.
    fn _group_finalize_partial_tail_offload(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        num_computed_tokens: usize,
        num_in_flight_tokens: usize,
    ) -> PyResult<Option<(u32, u32, usize)>> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        me.check_group(group)?;
        if me.inner.coord.slot(request_id).is_none() {
            return Ok(None);
        }
        Ok(me.inner.coord.in_request_slot(request_id, |coord, slot| {
            coord.managers[group].finalize_partial_tail_offload(slot, num_computed_tokens, num_in_flight_tokens)
        }))
    }

    /// Group `group`'s `cache_blocks(request, num_tokens, retention_interval,
    /// replay_boundaries=...)`: caches the request's blocks of that group only.
    #[pyo3(signature = (group, request, num_tokens, retention_interval=None, replay_boundaries=Vec::new()))]
    fn _group_cache_blocks(
        &self,
        py: Python<'_>,
        group: usize,
        request: &Bound<'_, PyAny>,
        num_tokens: usize,
        retention_interval: Option<usize>,
        replay_boundaries: Vec<usize>,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let me = &mut *me;
        let v = me.view(request, false)?;
        let hashes = me.hashes(request)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let events = me.event_inputs(request, p.inner.events_enabled())?;
        tagged_call(&mut me.inner, &mut p, request, events.as_ref(), &v, None, |m, pool, view| {
            m.group_cache_blocks(pool, group, view, &hashes, num_tokens, retention_interval, &replay_boundaries)
        })
    }

    /// The ids of the blocks allocated since the last call, every group, drained (vLLM's
    /// `take_new_block_ids`, for KV-cache zeroing).
    fn take_new_block_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        Ok(self.state.borrow_mut(py)?.inner.take_new_block_ids())
    }

    /// Group `group`'s `take_new_block_ids` (drained); empty for a group the manager lacks.
    fn _group_take_new_block_ids(&self, py: Python<'_>, group: usize) -> PyResult<Vec<u32>> {
        let mut me = self.state.borrow_mut(py)?;
        Ok(me.inner.coord.managers.get_mut(group).map(|m| m.take_new_block_ids()).unwrap_or_default())
    }

    /// Group `group`'s pending `new_block_ids` (not drained).
    fn _group_new_block_ids(&self, py: Python<'_>, group: usize) -> PyResult<Vec<u32>> {
        self.state
            .with(py, |me| me.inner.coord.managers.get(group).map(|m| m.st.new_block_ids.clone()).unwrap_or_default())
    }

    /// `take_kv_cache_block_copies`: the pending copy-on-write (source, copy) id pairs.
    fn _take_kv_cache_block_copies(&self, py: Python<'_>) -> PyResult<Vec<(u32, u32)>> {
        Ok(self.state.borrow_mut(py)?.inner.take_kv_cache_block_copies())
    }

    /// vLLM's `take_events()`: the KV events since the last call. `[]` with KV events off
    /// (vLLM's pool keeps none then), answered here; otherwise the subclass's
    /// `_take_pool_events()` (the pool's events, annotated as vLLM's manager does).
    fn take_events<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let enabled = slf.get().state.borrow(py)?.pool.get().state.borrow(py)?.inner.events_enabled();
        if !enabled {
            return Ok(PyList::empty(py).into_any());
        }
        slf.call_method0(intern!(py, "_take_pool_events"))
    }

    /// vLLM's `take_kv_cache_block_copies()`: the pending copy-on-write copies of partial
    /// hits, drained, and the blocks retained until they ran. `([], [])` when there are none
    /// (most steps), answered here; otherwise what the subclass's
    /// `_kv_cache_block_copies_of(pairs)` builds from the `(src_block_id, dst_block_id)` pairs.
    fn take_kv_cache_block_copies<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let pairs = slf.get().state.borrow_mut(py)?.inner.take_kv_cache_block_copies();
        if pairs.is_empty() {
            return Ok((PyList::empty(py), PyList::empty(py)).into_pyobject(py)?.into_any());
        }
        slf.call_method1(intern!(py, "_kv_cache_block_copies_of"), (pairs,))
    }

    /// vLLM's `take_boundary_state_offloads()`: the Mamba boundary states to offload since the
    /// last call, drained, as `{request_id: [(group, block_id, boundary_tokens), ...]}` in the
    /// order they were recorded (an empty dict, as most steps, without building anything else).
    fn take_boundary_state_offloads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let offloads = self.state.borrow_mut(py)?.inner.take_boundary_state_offloads();
        let out = PyDict::new(py);
        for (request_id, group, block_id, tokens) in offloads {
            let entry = (group, block_id, tokens).into_pyobject(py)?;
            match out.get_item(&request_id)? {
                Some(list) => list.cast_into::<PyList>()?.append(entry)?,
                None => out.set_item(&request_id, PyList::new(py, [entry])?)?,
            }
        }
        Ok(out)
    }

    /// `finalize_partial_tail_offloads(request)`: `(group, block id, boundary tokens)`.
    fn finalize_partial_tail_offloads(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(u32, u32, usize)>> {
        let mut me = self.state.borrow_mut(py)?;
        let v = me.view(request, false)?;
        let id = request_id_str(&v.id)?.to_owned();
        Ok(me.inner.finalize_partial_tail_offloads(&id, v.num_computed, v.num_in_flight_tokens))
    }

    /// `new_step_starts() -> None`: tell the manager a scheduler step begins (vLLM's
    /// `KVCacheManager.new_step_starts`, called once per step before its allocations): every
    /// group resets its per-step state (what it cached this step), and the live requests'
    /// per-request state is read ahead so the step's no-op calls find it in cache. Changes no
    /// block, table or reference count; raises nothing.
    fn new_step_starts(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self.state.borrow_mut(py)?;
        let me = &mut *guard;
        me.inner.coord.new_step_starts();
        let slots = &me.slots;
        me.inner.coord.warm_live_requests(|s| slots.warm(s) as u64);
        Ok(())
    }

    /// `estimate_cached_tokens(request)`.
    fn estimate_cached_tokens(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        let me = self.state.borrow(py)?;
        let id = me.id_of(request)?;
        let p = me.pool.get().state.borrow(py)?;
        me.inner.estimate_cached_tokens(&p.inner, request_id_str(&id)?).py_err()
    }

    /// `record_blocks_for_zeroing(request_id, start_token)`.
    fn record_blocks_for_zeroing(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        start_token: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        // vLLM's loop reads its arguments only for groups that record blocks for zeroing
        if me.inner.vllm_caller() && !me.inner.coord.managers.iter().any(|m| m.cfg.record_new_block_ids) {
            return Ok(());
        }
        let start_token = if me.inner.vllm_caller() {
            me.vllm_start_token(start_token)?
        } else {
            crate::py::args::count(start_token, "start_token")?
        };
        let request_id = id_arg(request_id, false)?.unwrap_or_default();
        me.inner.record_blocks_for_zeroing(request_id, start_token).py_err()
    }

    /// The request fields this manager reads from `request`'s `__dict__` now, skipping
    /// `getattr` (see `fast/instance_dict.rs`); the rest it reads with `getattr`. For tests.
    fn _dict_read_fields(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Vec<&'static str>> {
        Ok(self.state.borrow(py)?.fields.dict_read_fields(request))
    }

    /// The coordinator's configuration, for its Python view.
    fn _coordinator_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let me = self.state.borrow(py)?;
        let c = &me.inner.coord;
        let d = PyDict::new(py);
        d.set_item(
            "kind",
            match c.kind {
                crate::manager::coordinator::CoordinatorKind::NoPrefixCache => "no_prefix_cache",
                crate::manager::coordinator::CoordinatorKind::Unitary => "unitary",
                crate::manager::coordinator::CoordinatorKind::Hybrid => "hybrid",
            },
        )?;
        d.set_item("enable_partial_hash_hits", c.enable_partial_hash_hits)?;
        d.set_item("full_attention_group_id", c.full_attention_group_id)?;
        let ags: Vec<(Vec<u32>, bool)> =
            c.attention_groups.iter().map(|g| (g.group_ids.clone(), g.use_eagle)).collect();
        d.set_item("attention_groups", ags)?;
        d.set_item("cache_hit_alignment_tokens", c.cache_hit_alignment_tokens())?;
        d.set_item("scheduler_block_size", c.scheduler_block_size)?;
        d.set_item("hash_block_size", c.hash_block_size)?;
        d.set_item("num_reprefillable_tokens", c.num_reprefillable_tokens)?;
        let flags = |v: &Vec<bool>| v.iter().enumerate().filter(|(_, &f)| f).map(|(i, _)| i).collect::<Vec<_>>();
        d.set_item("eagle_group_ids", flags(&c.eagle_groups))?;
        d.set_item("drop_eagle_group_ids", flags(&c.drop_eagle_groups))?;
        d.set_item("retention_interval", c.retention_interval)?;
        d.set_item("mamba_shared_prefix_checkpoint", c.mamba_shared_prefix_checkpoint())?;
        let groups = PyList::empty(py);
        for m in &c.managers {
            let g = PyDict::new(py);
            g.set_item("block_size", m.cfg.block_size)?;
            g.set_item("dcp_world_size", m.cfg.dcp_world_size)?;
            g.set_item("pcp_world_size", m.cfg.pcp_world_size)?;
            g.set_item("use_eagle", m.cfg.use_eagle)?;
            g.set_item("cache_hit_alignment_tokens", m.cfg.cache_hit_alignment_tokens)?;
            g.set_item("max_admission_blocks_per_request", m.cfg.max_admission_blocks)?;
            g.set_item("records_new_block_ids", m.cfg.record_new_block_ids)?;
            g.set_item("enable_caching", m.cfg.enable_caching)?;
            g.set_item("shared_prefix_checkpoint", m.cfg.shared_prefix_checkpoint)?;
            g.set_item("drop_eagle_checkpoint_block", m.cfg.drop_eagle_checkpoint_block)?;
            g.set_item("scheduler_block_size", m.cfg.scheduler_block_size)?;
            groups.append(g)?;
        }
        d.set_item("groups", groups)?;
        Ok(d)
    }

    /// Group `group`'s `get_num_skipped_tokens(num_computed_tokens)`.
    fn _group_num_skipped_tokens(&self, py: Python<'_>, group: usize, num_computed_tokens: usize) -> PyResult<i64> {
        self.state
            .with(py, |me| {
                let m = me.inner.coord.managers.get(group)?;
                Some(match m.cfg.spec.kind {
                    Kind::Mamba { .. } => num_computed_tokens as i64 - 1,
                    _ => m.cfg.num_skipped_tokens(num_computed_tokens) as i64,
                })
            })?
            .ok_or_else(|| value_err("group", "out of range"))
    }
}
