//! `KVCacheManagerCore`'s HiSparse calls: the coordinator calls vLLM's HiSparse connector makes
//! (`advance_scheduled`, `build_offload_command`, `update_spills`, `update_residency`) and the
//! reads of its state, on the residency the manager holds (`crate::manager::hisparse_tier`).
//! Thin: the coordinator view of `kvblock.vllm` (not written yet, `docs/hisparse.md`) and the
//! manager lockstep call these. Every call first drains the device pool's fired reuse
//! watchers into the residency. A manager without HiSparse groups raises `RuntimeError`.

use super::*;
use crate::error::Result;
use crate::hisparse::residency::Residency;
use crate::manager::hisparse_tier::TierEnv;

fn no_hisparse() -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err("this KV cache manager has no HiSparse groups")
}

impl PyManager {
    /// Run `f` on the manager's residency over its device pool.
    fn residency<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Residency, &mut TierEnv<'_>) -> Result<R>,
    ) -> PyResult<R> {
        let mut me = self.state.borrow_mut(py)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner.coord.with_residency(&mut p.inner, f).py_err()?.ok_or_else(no_hisparse)
    }
}

#[pymethods]
impl PyManager {
    /// `advance_scheduled([(request_id, num_computed_tokens_after_the_step), ...])`.
    fn _hisparse_advance_scheduled(&self, py: Python<'_>, requests: Vec<(String, usize)>) -> PyResult<()> {
        self.residency(py, |r, e| r.advance_scheduled(e, &requests))
    }

    /// `update_residency(request_id)`.
    fn _hisparse_update_residency(&self, py: Python<'_>, request_id: String) -> PyResult<()> {
        self.residency(py, |r, e| r.update_residency(e, &request_id))
    }

    /// `build_offload_command()`'s page transfers, taken: None when there are none, else
    /// `(transfer_id, host_block_id, resident_block_ids, after_forward, restore)` each.
    #[allow(clippy::type_complexity)]
    fn _hisparse_take_offload_command(
        &self,
        py: Python<'_>,
    ) -> PyResult<Option<Vec<(u64, u32, Vec<u32>, bool, bool)>>> {
        self.residency(py, |r, _| {
            Ok(r.take_offload_command().map(|v| {
                v.into_iter()
                    .map(|t| (t.transfer_id, t.host_block_id, t.resident_block_ids, t.after_forward, t.restore))
                    .collect()
            }))
        })
    }

    /// `update_spills(enqueued, completed)`: `[(transfer_id, workers), ...]` each.
    fn _hisparse_update_spills(
        &self,
        py: Python<'_>,
        enqueued: Vec<(u64, usize)>,
        completed: Vec<(u64, usize)>,
    ) -> PyResult<()> {
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
            if k >= r.layout().resident_groups.len() {
                return Err(crate::error::Error::value("k", format!("{k} is not a resident group index")));
            }
            Ok(r.get_residency_row(e, k, &request_id, start))
        })
    }

    /// `hot_managers[k].hot_required`, sorted.
    fn _hisparse_hot_required(&self, py: Python<'_>, k: usize) -> PyResult<Vec<String>> {
        self.residency(py, |r, _| {
            if k >= r.layout().hot_groups.len() {
                return Err(crate::error::Error::value("k", format!("{k} is not a hot group index")));
            }
            let mut v: Vec<String> = r.hot_required(k).iter().cloned().collect();
            v.sort();
            Ok(v)
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
}
