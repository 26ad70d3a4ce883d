//! `KVCacheManagerCore`'s HiSparse calls: the coordinator calls vLLM's HiSparse connector makes
//! (`advance_scheduled`, `build_offload_command`, `update_spills`, `update_residency`) and the
//! reads of its state, on the residency the manager holds (`crate::manager::hisparse_tier`).
//! Thin: the coordinator view of `kvblock.vllm` (not written yet, `docs/hisparse.md`) and the
//! manager lockstep call these. Every call first drains the device pool's fired reuse
//! watchers into the residency. A manager without HiSparse groups raises `RuntimeError`.

use super::*;
use crate::error::Result;
use crate::hisparse::residency::{Env, Residency};
use crate::manager::hisparse_tier::TierEnv;

/// `ValueError` unless `k` indexes one of the resident groups.
fn resident_index(r: &Residency, k: usize) -> Result<()> {
    if k >= r.layout().resident_groups.len() {
        return Err(crate::error::Error::value("k", format!("{k} is not a resident group index")));
    }
    Ok(())
}

/// `ValueError` unless `k` indexes one of the hot groups.
fn hot_index(r: &Residency, k: usize) -> Result<()> {
    if k >= r.layout().hot_groups.len() {
        return Err(crate::error::Error::value("k", format!("{k} is not a hot group index")));
    }
    Ok(())
}

/// `{transfer_id: workers}` (a mapping) or `(transfer_id, workers)` pairs.
fn worker_counts(counts: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, usize)>> {
    let pairs = match counts.cast::<pyo3::types::PyDict>() {
        Ok(d) => return d.iter().map(|(k, v)| Ok((k.extract()?, v.extract()?))).collect(),
        Err(_) if counts.hasattr(pyo3::intern!(counts.py(), "items"))? => {
            counts.call_method0(pyo3::intern!(counts.py(), "items"))?
        }
        Err(_) => counts.clone(),
    };
    let mut out = Vec::new();
    for pair in pairs.try_iter()? {
        out.push(pair?.extract::<(u64, usize)>()?);
    }
    Ok(out)
}

pub(super) fn no_hisparse() -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err("this KV cache manager has no HiSparse groups")
}

impl PyManager {
    /// Run `f` on the manager's residency over its device pool.
    pub(super) fn residency<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Residency, &mut TierEnv<'_>) -> Result<R>,
    ) -> PyResult<R> {
        let mut me = self.state.borrow_mut(py)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let out = me.inner.coord.with_residency(&mut p.inner, f).py_err()?.ok_or_else(no_hisparse);
        sync_kept_tags(&me.inner.coord, &mut p);
        out
    }
}

#[pymethods]
impl PyManager {
    /// `advance_scheduled(requests)`: `(request_id, num_computed_tokens after the step)`
    /// rows, any iterable. `TypeError` for a malformed row; nothing changes then.
    fn _hisparse_advance_scheduled(&self, py: Python<'_>, requests: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut objs = Vec::new();
        for row in requests.try_iter()? {
            objs.push(row?.extract::<(Bound<'_, pyo3::types::PyString>, usize)>()?);
        }
        let rows = objs.iter().map(|(id, n)| Ok((id.to_str()?, *n))).collect::<PyResult<Vec<(&str, usize)>>>()?;
        self.residency(py, |r, e| r.advance_scheduled(e, &rows))
    }

    /// A residency reuse watcher called by hand (vLLM's `_reuse_watchers[block_id](block)`):
    /// the pages whose released device blocks these are are lost, as when the pool reuses them.
    fn _hisparse_on_blocks_reused(&self, py: Python<'_>, block_ids: Vec<u32>) -> PyResult<()> {
        self.residency(py, |r, e| {
            r.on_blocks_reused(e, &block_ids);
            Ok(())
        })
    }

    /// Set vLLM 0.34's `import_step_tokens` (`get_hisparse_coordinator(manager,
    /// import_step_tokens=...)`'s first call). ValueError before 0.34, AssertionError once a
    /// request was admitted; nothing changes then.
    fn _hisparse_set_import_step_tokens(&self, py: Python<'_>, import_step_tokens: usize) -> PyResult<()> {
        self.state.borrow_mut(py)?.inner.coord.set_hisparse_import_step_tokens(import_step_tokens).py_err()
    }

    /// `update_residency(request_id)`.
    fn _hisparse_update_residency(&self, py: Python<'_>, request_id: String) -> PyResult<()> {
        self.residency(py, |r, e| r.update_residency(e, &request_id))
    }

    /// `update_spills(enqueued, completed)`: `{transfer_id: workers}` each (a mapping, or
    /// `(transfer_id, workers)` pairs). `TypeError` for a malformed entry; nothing changes then.
    fn _hisparse_update_spills(
        &self,
        py: Python<'_>,
        enqueued: &Bound<'_, PyAny>,
        completed: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (enqueued, completed) = (worker_counts(enqueued)?, worker_counts(completed)?);
        self.residency(py, |r, e| r.update_spills(e, &enqueued, &completed))
    }

    /// `resident_managers[k].get_residency_row(request_id, start)`: block ids, the null block
    /// (0) for a page read from the host.
    #[pyo3(signature = (k, request_id, start=0))]
    fn _hisparse_residency_row(
        &self,
        py: Python<'_>,
        k: usize,
        request_id: String,
        start: usize,
    ) -> PyResult<Vec<u32>> {
        self.residency(py, |r, e| {
            resident_index(r, k)?;
            Ok(r.get_residency_row(e, k, &request_id, start))
        })
    }

    /// `hot_managers[k].hot_required`, sorted.
    fn _hisparse_hot_required(&self, py: Python<'_>, k: usize) -> PyResult<Vec<String>> {
        self.residency(py, |r, _| {
            hot_index(r, k)?;
            let mut v: Vec<String> = r.hot_required(k).iter().cloned().collect();
            v.sort();
            Ok(v)
        })
    }

    /// `hot_managers[k].require_hot(request_id)`: the request asks hot group `k` for a hot
    /// region (allocated by its next `allocate_slots`). A `k` past the hot groups is a
    /// `ValueError`, nothing changed.
    fn _hisparse_require_hot(&self, py: Python<'_>, k: usize, request_id: String) -> PyResult<()> {
        self.residency(py, |r, _| {
            hot_index(r, k)?;
            r.require_hot(k, &request_id);
            Ok(())
        })
    }

    /// Set `max_spill_pages` and / or `transition_watermark` (vLLM's plain attributes);
    /// None leaves one as it is. Negative numbers are refused by the conversion (nothing set).
    #[pyo3(signature = (max_spill_pages=None, transition_watermark=None))]
    fn _hisparse_set_limits(
        &self,
        py: Python<'_>,
        max_spill_pages: Option<usize>,
        transition_watermark: Option<usize>,
    ) -> PyResult<()> {
        self.residency(py, |r, _| {
            if let Some(n) = max_spill_pages {
                r.set_max_spill_pages(n);
            }
            if let Some(n) = transition_watermark {
                r.set_transition_watermark(n);
            }
            Ok(())
        })
    }

    /// `resident_managers[k].residency_changes`: `[(request_id, [(page, block_id), ...])]`
    /// (the overlay itself: a dropped page as the null block 0), sorted by request and page.
    #[allow(clippy::type_complexity)]
    fn _hisparse_residency_changes(&self, py: Python<'_>, k: usize) -> PyResult<Vec<(String, Vec<(usize, u32)>)>> {
        self.residency(py, |r, _| {
            resident_index(r, k)?;
            let mut v: Vec<(String, Vec<(usize, u32)>)> = r
                .residency_changes(k)
                .iter()
                .map(|(q, c)| (q.clone(), c.iter().map(|(&p, &b)| (p, b)).collect()))
                .collect();
            v.sort();
            Ok(v)
        })
    }

    /// `resident_managers[k].drop_resident_page(request_id, page)`: stop reading the page from
    /// the device; the block id it was read from, None if it had none.
    fn _hisparse_drop_resident_page(
        &self,
        py: Python<'_>,
        k: usize,
        request_id: String,
        page: usize,
    ) -> PyResult<Option<u32>> {
        self.residency(py, |r, e| {
            resident_index(r, k)?;
            Ok(r.drop_resident_page(e, k, &request_id, page))
        })
    }

    /// `resident_managers[k].adopt_resident_page(request_id, page, block_id)`: read a
    /// host-only page from device block `block_id` (no reference taken, as vLLM's). A block id
    /// outside the device pool is a `ValueError`, nothing changed.
    fn _hisparse_adopt_resident_page(
        &self,
        py: Python<'_>,
        k: usize,
        request_id: String,
        page: usize,
        block_id: u32,
    ) -> PyResult<bool> {
        self.residency(py, |r, e| {
            resident_index(r, k)?;
            let n = e.device_ref().num_blocks();
            if block_id == 0 || block_id as usize >= n {
                return Err(crate::error::Error::value(
                    "block_id",
                    format!("{block_id} is not a device block (1..{n})"),
                ));
            }
            Ok(r.adopt_resident_page(e, k, &request_id, page, block_id))
        })
    }

    /// `commit_computed_blocks(request_id, num_host_pages)`: a prefix hit on the request's
    /// first `num_host_pages` host pages (capped at the host pages it holds).
    fn _hisparse_commit_computed_blocks(
        &self,
        py: Python<'_>,
        request_id: String,
        num_host_pages: usize,
    ) -> PyResult<()> {
        self.residency(py, |r, e| {
            r.commit_computed_blocks(e, &request_id, num_host_pages);
            Ok(())
        })
    }

    /// `has_pending_work()`.
    fn _hisparse_has_pending_work(&self, py: Python<'_>) -> PyResult<bool> {
        self.residency(py, |r, _| Ok(r.has_pending_work()))
    }

    /// `has_pending_reclamation()`.
    fn _hisparse_has_pending_reclamation(&self, py: Python<'_>) -> PyResult<bool> {
        self.residency(py, |r, e| Ok(r.has_pending_reclamation(e)))
    }

    /// The layout the coordinator view reads once: `(host_group, resident_groups,
    /// [(hot_group, blocks_per_request)], max_spill_pages, transition_watermark)`.
    #[allow(clippy::type_complexity)]
    fn _hisparse_layout(&self, py: Python<'_>) -> PyResult<(usize, Vec<usize>, Vec<(usize, usize)>, usize, usize)> {
        self.residency(py, |r, _| {
            let l = r.layout();
            Ok((
                l.host_group,
                l.resident_groups.clone(),
                l.hot_groups.clone(),
                r.max_spill_pages(),
                r.transition_watermark(),
            ))
        })
    }

    /// `resident_managers[k].get_resident_page(request_id, page)`: the block id, None when
    /// the page has no GPU copy.
    fn _hisparse_resident_page(
        &self,
        py: Python<'_>,
        k: usize,
        request_id: String,
        page: usize,
    ) -> PyResult<Option<u32>> {
        self.residency(py, |r, e| {
            resident_index(r, k)?;
            Ok(r.get_resident_page(e, k, &request_id, page))
        })
    }

    /// `all_context_pages_resident([(request_id, num_computed_tokens, num_scheduled_tokens)])`.
    fn _hisparse_all_context_pages_resident(&self, py: Python<'_>, requests: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rows = super::hisparse_objects::request_rows(requests)?;
        let requests = super::hisparse_objects::row_ids(&rows)?;
        self.residency(py, |r, e| Ok(r.all_context_pages_resident(e, &requests)))
    }

    /// `spills_to_send` (not taken): `(transfer_id, host_block_id, resident_block_ids,
    /// after_forward, restore)` each.
    #[allow(clippy::type_complexity)]
    fn _hisparse_spills_to_send(&self, py: Python<'_>) -> PyResult<Vec<(u64, u32, Vec<u32>, bool, bool)>> {
        self.residency(py, |r, _| {
            Ok(r.spills_to_send()
                .iter()
                .map(|t| (t.transfer_id, t.host_block_id, t.resident_block_ids.clone(), t.after_forward, t.restore))
                .collect())
        })
    }

    /// `pending_spills` as `[(transfer_id, request_id, page, host_block, resident_blocks,
    /// restore, expected, completed, enqueue_applied)]`, by transfer id.
    #[allow(clippy::type_complexity)]
    fn _hisparse_pending_spills(
        &self,
        py: Python<'_>,
    ) -> PyResult<Vec<(u64, String, usize, u32, Vec<u32>, bool, usize, usize, bool)>> {
        self.residency(py, |r, _| {
            Ok(r.pending_spills()
                .values()
                .map(|p| {
                    (
                        p.transfer_id,
                        p.request.to_string(),
                        p.page,
                        p.host_block,
                        p.resident_blocks.to_vec(),
                        p.restore,
                        p.expected_worker_completions,
                        p.worker_completions,
                        p.enqueue_applied,
                    )
                })
                .collect())
        })
    }

    /// `copies` as `[(host key bytes, device block ids per resident group)]`, sorted.
    fn _hisparse_copies(&self, py: Python<'_>) -> PyResult<Vec<(Vec<u8>, Vec<u32>)>> {
        self.residency(py, |r, _| {
            let mut v: Vec<(Vec<u8>, Vec<u32>)> = r.copies().iter().map(|(k, b)| (k.to_bytes(), b.to_vec())).collect();
            v.sort();
            Ok(v)
        })
    }

    /// `request_states` as `[(request_id, valid_pages, ready_prefix_pages, pending_pages
    /// [(page, transfer_id)], copies_recorded_blocks, pinned_clean, unpinned_pages,
    /// pages_to_adopt, synced_pages, stale_pages)]` (page sets sorted).
    #[allow(clippy::type_complexity)]
    fn _hisparse_request_states(
        &self,
        py: Python<'_>,
    ) -> PyResult<
        Vec<(String, Vec<usize>, usize, Vec<(usize, u64)>, usize, Vec<usize>, Vec<usize>, usize, usize, Vec<usize>)>,
    > {
        self.residency(py, |r, _| {
            let mut v: Vec<_> = r
                .request_states()
                .map(|(q, s)| {
                    (
                        q.to_string(),
                        s.valid_pages.iter().copied().collect::<Vec<usize>>(),
                        s.ready_prefix_pages,
                        s.pending_pages.iter().map(|(&p, &t)| (p, t)).collect::<Vec<(usize, u64)>>(),
                        s.copies_recorded_blocks,
                        s.pinned_clean.iter().copied().collect::<Vec<usize>>(),
                        s.unpinned_pages.iter().copied().collect::<Vec<usize>>(),
                        s.pages_to_adopt,
                        s.synced_pages,
                        s.stale_pages.iter().copied().collect::<Vec<usize>>(),
                    )
                })
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(v)
        })
    }

    /// `plan_prefix_materialization(request_id, num_computed_tokens)`.
    fn _hisparse_plan_prefix_materialization(
        &self,
        py: Python<'_>,
        request_id: String,
        num_computed_tokens: usize,
    ) -> PyResult<()> {
        self.residency(py, |r, e| r.plan_prefix_materialization(e, &request_id, num_computed_tokens))
    }

    /// `record_pending_host_import(request_id, num_tokens)`.
    fn _hisparse_record_pending_host_import(
        &self,
        py: Python<'_>,
        request_id: String,
        num_tokens: usize,
    ) -> PyResult<()> {
        self.residency(py, |r, _| {
            r.record_pending_host_import(&request_id, num_tokens);
            Ok(())
        })
    }

    /// `finish_host_import(request_id, failed)`.
    fn _hisparse_finish_host_import(&self, py: Python<'_>, request_id: String, failed: bool) -> PyResult<()> {
        self.residency(py, |r, e| r.finish_host_import(e, &request_id, failed))
    }

    /// `complete_host_import(request_id, num_computed_tokens)`.
    fn _hisparse_complete_host_import(
        &self,
        py: Python<'_>,
        request_id: String,
        num_computed_tokens: usize,
    ) -> PyResult<()> {
        self.residency(py, |r, e| r.complete_host_import(e, &request_id, num_computed_tokens))
    }

    /// The host pool: `(num_blocks, num_free_blocks, enable_caching, hash_block_size)`.
    fn _hisparse_host_info(&self, py: Python<'_>) -> PyResult<(usize, usize, bool, usize)> {
        self.residency(py, |_, e| {
            let h = e.host_ref();
            Ok((h.num_blocks(), h.num_free_blocks(), h.enable_caching(), h.hash_block_size()))
        })
    }

    /// Host block `block_id`: `(ref_cnt, block_hash bytes or None, block_hash_num_tokens)`.
    /// ValueError for an id outside the host pool.
    #[allow(clippy::type_complexity)]
    fn _hisparse_host_block(&self, py: Python<'_>, block_id: u32) -> PyResult<(u32, Option<Vec<u8>>, Option<usize>)> {
        self.residency(py, |_, e| {
            let h = e.host_ref();
            Ok((h.ref_cnt(block_id)?, h.block_key(block_id)?.map(|k| k.to_bytes()), h.block_hash_num_tokens(block_id)?))
        })
    }

    /// Host pool `get_new_blocks(n)`: the ids, each with one reference. ValueError, nothing
    /// taken, when fewer are free.
    fn _hisparse_host_get_new_blocks(&self, py: Python<'_>, n: usize) -> PyResult<Vec<u32>> {
        self.residency(py, |_, e| {
            let mut out = Vec::with_capacity(n);
            e.host().get_new_blocks(n, &mut out)?;
            Ok(out)
        })
    }

    /// Host pool `touch(ids)` (the null block skipped). ValueError, nothing changed, for a bad id.
    fn _hisparse_host_touch(&self, py: Python<'_>, ids: Vec<u32>) -> PyResult<()> {
        self.residency(py, |_, e| e.host().touch(&ids, true))
    }

    /// Host pool `free_blocks(ids)` in order (the null block skipped). ValueError, nothing
    /// changed, for a bad id or a block with no reference left.
    fn _hisparse_host_free(&self, py: Python<'_>, ids: Vec<u32>) -> PyResult<()> {
        self.residency(py, |_, e| e.host().free_blocks(&ids, true))
    }

    /// Host pool `evict_blocks(ids)`. ValueError, nothing evicted, for a bad id.
    fn _hisparse_host_evict(&self, py: Python<'_>, ids: Vec<u32>) -> PyResult<()> {
        self.residency(py, |_, e| e.host().evict_blocks(&ids))
    }

    /// The source group's `take_host_cow_copies()`: its pending copy-on-write `(source,
    /// copy)` host block id pairs, drained, not retained.
    fn _hisparse_take_host_cow_copies(&self, py: Python<'_>) -> PyResult<Vec<(u32, u32)>> {
        let mut me = self.state.borrow_mut(py)?;
        if me.inner.coord.hisparse().is_none() {
            return Err(no_hisparse());
        }
        Ok(me.inner.coord.hisparse_take_host_cow_copies())
    }

    /// `take_host_block_copies()`: the host copy-on-write `(source, copy)` host block id
    /// pairs, drained and retained (both endpoints) until `release_completed_host_copies`.
    fn _hisparse_take_host_block_copies(&self, py: Python<'_>) -> PyResult<Vec<(u32, u32)>> {
        let mut me = self.state.borrow_mut(py)?;
        if me.inner.coord.hisparse().is_none() {
            return Err(no_hisparse());
        }
        Ok(me.inner.coord.hisparse_take_host_block_copies())
    }

    /// `release_completed_host_copies(dst_block_ids)`: the retained copies with those
    /// destination ids free both endpoints into the host pool (unknown ids ignored).
    fn _hisparse_release_completed_host_copies(&self, py: Python<'_>, dst_block_ids: Vec<u32>) -> PyResult<()> {
        self.residency(py, |r, e| r.release_completed_host_copies(e, &dst_block_ids))
    }

    /// `pop_blocks_for_free(request)` of a manager with HiSparse groups: `[(block_id,
    /// is_host), ...]` in group order (host blocks are the source group's, freed into the
    /// host pool), the request forgotten and the coordinator's `free(request)` made with
    /// `request.is_finished()`.
    fn _hisparse_pop_blocks_for_free(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, bool)>> {
        if self.state.borrow(py)?.inner.coord.hisparse().is_none() {
            return Err(no_hisparse());
        }
        let finished = request.call_method0(Field::IsFinished.interned(py))?.is_truthy()?;
        let mut me = self.state.borrow_mut(py)?;
        let id = me.id_of(request)?;
        me.slots.remove(request);
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner.coord.pop_blocks_for_free_routed(&mut p.inner, request_id_str(&id)?, finished).py_err()
    }
}
