//! Binding of the HiSparse residency (`crate::hisparse::residency`) over two kvblock pools
//! (`HiSparseResidency`): the block tables are set from Python, so that the residency can be
//! driven next to vLLM's own `HiSparseCoordinator` (`tests/test_vllm_hisparse_lockstep.py`)
//! before kvblock's manager holds HiSparse groups itself. Host publication keys each host
//! block under the page hashes given with `set_hashes`.

use super::args;
use super::block_pool::PyBlockPool;
use super::errors::{value_err, IntoPy};
use crate::error::Result;
use crate::hashing::Digest;
use crate::hisparse::residency::{Env, Layout, Residency, RESIDENCY_WATCHER};
use crate::pool::block_pool::BlockPool;
use crate::pool::cache_map::Key;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::HashMap;
use std::sync::Mutex;

struct Tables {
    tables: HashMap<(usize, String), Vec<u32>>,
    hashes: HashMap<String, Vec<Digest>>,
    host_group: u32,
}

struct PoolsEnv<'a> {
    t: &'a Tables,
    device: &'a mut BlockPool,
    host: &'a mut BlockPool,
}

impl PoolsEnv<'_> {
    fn key_host_blocks(&mut self, request: &str, blocks: &[u32], upto: usize) -> Result<()> {
        let hashes = self.t.hashes.get(request).map(|v| v.as_slice()).unwrap_or(&[]);
        for (page, &b) in blocks.iter().enumerate().take(upto) {
            let Some(&hash) = hashes.get(page) else { break };
            if b == 0 || self.host.block_key(b)?.is_some() {
                continue;
            }
            let key = Key { hash, group: self.t.host_group };
            self.host.set_block_hash(b, key, None)?;
            self.host.map_insert(key, b)?;
        }
        Ok(())
    }
}

impl Env for PoolsEnv<'_> {
    fn table(&self, group: usize, request: &str) -> Option<&[u32]> {
        self.t.tables.get(&(group, request.to_string())).map(|v| v.as_slice())
    }
    fn num_cached(&self, _group: usize, _request: &str) -> usize {
        0
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
    fn publish(&mut self, request: &str, num_tokens: usize) -> Result<()> {
        let g = self.t.host_group as usize;
        let blocks = self.t.tables.get(&(g, request.to_string())).cloned().unwrap_or_default();
        let bs = self.host.hash_block_size();
        self.key_host_blocks(request, &blocks, num_tokens / bs)
    }
    fn publish_detached(&mut self, request: &str, blocks: &[u32], _num_cached: usize, num_full: usize) -> Result<()> {
        self.key_host_blocks(request, blocks, num_full)
    }
}

/// `HiSparseResidency(host_group, block_size, resident_groups, admission_caps, hot_groups,
/// num_blocks, max_model_len, num_reprefillable_tokens, device_pool, host_pool)`: vLLM's
/// `HiSparseCoordinator` books over two kvblock pools (``hot_groups``: ``[(group,
/// blocks_per_request)]``). ValueError as vLLM's coordinator raises.
#[pyclass(module = "kvblock._core", name = "HiSparseResidency", frozen)]
pub struct PyResidency {
    res: Mutex<Residency>,
    tables: Mutex<Tables>,
    device: Py<PyBlockPool>,
    host: Py<PyBlockPool>,
}

impl PyResidency {
    fn run<R>(&self, py: Python<'_>, f: impl FnOnce(&mut Residency, &mut PoolsEnv<'_>) -> Result<R>) -> PyResult<R> {
        let mut res = self.res.lock().map_err(|_| value_err("residency", "poisoned"))?;
        let t = self.tables.lock().map_err(|_| value_err("residency", "poisoned"))?;
        let dev = self.device.bind(py).get();
        let host = self.host.bind(py).get();
        let mut d = dev.state.borrow_mut(py)?;
        let mut h = host.state.borrow_mut(py)?;
        let mut env = PoolsEnv { t: &t, device: &mut d.inner, host: &mut h.inner };
        // the device blocks the pool handed out since the last call: lose their pages first
        let fired: Vec<u32> = env
            .device
            .take_fired_watchers()
            .into_iter()
            .filter(|&(_, w)| w == RESIDENCY_WATCHER)
            .map(|(b, _)| b)
            .collect();
        res.on_blocks_reused(&env, &fired);
        f(&mut res, &mut env).py_err()
    }
}

#[pymethods]
impl PyResidency {
    #[new]
    #[allow(clippy::too_many_arguments)] // the coordinator's configuration, as vLLM reads it
    fn new(
        #[pyo3(from_py_with = args::host_group)] host_group: usize,
        #[pyo3(from_py_with = args::block_size_count)] block_size: usize,
        #[pyo3(from_py_with = args::resident_groups)] resident_groups: Vec<usize>,
        #[pyo3(from_py_with = args::admission_caps)] admission_caps: Vec<usize>,
        #[pyo3(from_py_with = args::hot_groups)] hot_groups: Vec<(usize, usize)>,
        #[pyo3(from_py_with = args::num_blocks_count)] num_blocks: usize,
        #[pyo3(from_py_with = args::max_model_len)] max_model_len: usize,
        #[pyo3(from_py_with = args::num_reprefillable_tokens)] num_reprefillable_tokens: usize,
        device_pool: Py<PyBlockPool>,
        host_pool: Py<PyBlockPool>,
    ) -> PyResult<Self> {
        if device_pool.is(&host_pool) {
            return Err(value_err("host_pool", "the host pool must not be the device pool"));
        }
        let n = resident_groups.len();
        let res = Residency::new(Layout {
            host_group,
            host_block_size: block_size,
            resident_groups,
            resident_block_sizes: vec![block_size; n],
            resident_admission_caps: admission_caps,
            hot_groups,
            num_blocks,
            max_model_len,
            num_reprefillable_tokens,
            import_step_tokens: 0,
        })
        .py_err()?;
        let tables = Tables { tables: HashMap::new(), hashes: HashMap::new(), host_group: host_group as u32 };
        Ok(PyResidency { res: Mutex::new(res), tables: Mutex::new(tables), device: device_pool, host: host_pool })
    }

    /// Set (or with None, remove) `request`'s block table in `group`: block ids of the host
    /// pool for the host group, of the device pool otherwise (ValueError for an id outside
    /// the pool, nothing changed).
    fn set_table(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::group)] group: usize,
        request: String,
        #[pyo3(from_py_with = args::opt_ids)] ids: Option<Vec<u32>>,
    ) -> PyResult<()> {
        let mut t = self.tables.lock().map_err(|_| value_err("residency", "poisoned"))?;
        if let Some(v) = &ids {
            let pool = if group == t.host_group as usize { &self.host } else { &self.device };
            pool.bind(py).get().state.borrow(py)?.inner.check_ids(v).py_err()?;
        }
        match ids {
            Some(v) => t.tables.insert((group, request), v),
            None => t.tables.remove(&(group, request)),
        };
        Ok(())
    }

    /// The page hashes host publication keys `request`'s host blocks under.
    fn set_hashes(&self, request: String, hashes: Vec<Vec<u8>>) -> PyResult<()> {
        let d = hashes
            .iter()
            .map(|h| Digest::from_slice(h).ok_or_else(|| value_err("hashes", "a hash has 1 to 32 bytes")))
            .collect::<PyResult<Vec<_>>>()?;
        self.tables.lock().map_err(|_| value_err("residency", "poisoned"))?.hashes.insert(request, d);
        Ok(())
    }

    fn advance_scheduled(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::requests_pairs)] requests: Vec<(String, usize)>,
    ) -> PyResult<()> {
        self.run(py, |r, e| r.advance_scheduled(e, &requests))
    }

    fn update_residency(&self, py: Python<'_>, request: String) -> PyResult<()> {
        self.run(py, |r, e| r.update_residency(e, &request))
    }

    fn publish_when_ready(
        &self,
        py: Python<'_>,
        request: String,
        #[pyo3(from_py_with = args::num_computed_tokens_count)] num_computed_tokens: usize,
    ) -> PyResult<()> {
        self.run(py, |r, e| r.publish_when_ready(e, &request, num_computed_tokens))
    }

    fn commit_computed_blocks(
        &self,
        py: Python<'_>,
        request: String,
        #[pyo3(from_py_with = args::num_host_pages)] num_host_pages: usize,
    ) -> PyResult<()> {
        self.run(py, |r, e| {
            r.commit_computed_blocks(e, &request, num_host_pages);
            Ok(())
        })
    }

    /// `update_spills(enqueued, completed)` with `{transfer_id: count}` dicts.
    fn update_spills(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::enqueued)] enqueued: Vec<(u64, usize)>,
        #[pyo3(from_py_with = args::completed)] completed: Vec<(u64, usize)>,
    ) -> PyResult<()> {
        self.run(py, |r, e| r.update_spills(e, &enqueued, &completed))
    }

    /// The planned transfers, drained: `(transfer_id, host_block_id, resident_block_ids,
    /// after_forward, restore)` each.
    #[allow(clippy::type_complexity)]
    fn take_offload_command(&self, py: Python<'_>) -> PyResult<Option<Vec<(u64, u32, Vec<u32>, bool, bool)>>> {
        self.run(py, |r, _| {
            Ok(r.take_offload_command().map(|v| {
                v.into_iter()
                    .map(|t| (t.transfer_id, t.host_block_id, t.resident_block_ids, t.after_forward, t.restore))
                    .collect()
            }))
        })
    }

    /// `{request: (pages, block_ids per resident group)}`.
    #[allow(clippy::type_complexity)]
    fn take_residency_updates(
        &self,
        py: Python<'_>,
        requests: Vec<String>,
    ) -> PyResult<Vec<(String, Vec<usize>, Vec<Vec<u32>>)>> {
        self.run(py, |r, e| {
            Ok(r.take_residency_updates(e, &requests).into_iter().map(|(q, u)| (q, u.pages, u.block_ids)).collect())
        })
    }

    /// `free(request)`; `finished`: the request finished (not preempted).
    fn free(&self, py: Python<'_>, request: String, finished: bool) -> PyResult<()> {
        self.run(py, |r, e| r.free(e, &request, finished))
    }

    /// Forget `request`'s resident overlay and hot requirement (the managers'
    /// `pop_blocks_for_free`).
    fn forget(&self, request: String) -> PyResult<()> {
        let mut r = self.res.lock().map_err(|_| value_err("residency", "poisoned"))?;
        r.forget_overlay(&request);
        for k in 0..r.layout().hot_groups.len() {
            r.release_hot(k, &request);
        }
        Ok(())
    }

    /// `get_residency_row(request, start)` of resident group `k`.
    fn get_residency_row(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::k)] k: usize,
        request: String,
        #[pyo3(from_py_with = args::start_count)] start: usize,
    ) -> PyResult<Vec<u32>> {
        if k >= self.res.lock().map_err(|_| value_err("residency", "poisoned"))?.layout().resident_groups.len() {
            return Err(value_err("k", "no such resident group"));
        }
        self.run(py, |r, e| Ok(r.get_residency_row(e, k, &request, start)))
    }

    /// Sorted `hot_required` of hot group `k`.
    fn hot_required(&self, #[pyo3(from_py_with = args::k)] k: usize) -> PyResult<Vec<String>> {
        let r = self.res.lock().map_err(|_| value_err("residency", "poisoned"))?;
        let set = r
            .layout()
            .hot_groups
            .get(k)
            .map(|_| r.hot_required(k))
            .ok_or_else(|| value_err("k", "no such hot group"))?;
        let mut v: Vec<String> = set.iter().cloned().collect();
        v.sort();
        Ok(v)
    }

    /// `request_states` as `{request: {field: value}}` (page sets as sorted lists).
    fn request_states<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.res.lock().map_err(|_| value_err("residency", "poisoned"))?;
        let out = PyDict::new(py);
        for (q, s) in r.request_states() {
            let d = PyDict::new(py);
            d.set_item("valid_pages", s.valid_pages.iter().collect::<Vec<_>>())?;
            d.set_item("ready_prefix_pages", s.ready_prefix_pages)?;
            d.set_item("pending_pages", s.pending_pages.iter().map(|(&p, &t)| (p, t)).collect::<Vec<_>>())?;
            d.set_item("copies_recorded_blocks", s.copies_recorded_blocks)?;
            d.set_item("pinned_clean", s.pinned_clean.iter().collect::<Vec<_>>())?;
            d.set_item("unpinned_pages", s.unpinned_pages.iter().collect::<Vec<_>>())?;
            d.set_item("pages_to_adopt", s.pages_to_adopt)?;
            d.set_item("synced_pages", s.synced_pages)?;
            d.set_item("stale_pages", s.stale_pages.iter().collect::<Vec<_>>())?;
            d.set_item("publication", s.publication.as_ref().map(|p| (p.num_computed_tokens, p.num_pages)))?;
            out.set_item(q, d)?;
        }
        Ok(out)
    }

    /// `pending_spills` as `[(transfer_id, request, page, host_block, resident_blocks,
    /// restore, expected, completed, enqueue_applied)]`, by transfer id.
    #[allow(clippy::type_complexity)]
    fn pending_spills(&self) -> PyResult<Vec<(u64, String, usize, u32, Vec<u32>, bool, usize, usize, bool)>> {
        let r = self.res.lock().map_err(|_| value_err("residency", "poisoned"))?;
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
    }

    /// `copies` as `{host key bytes: device block ids}`.
    fn copies(&self) -> PyResult<Vec<(Vec<u8>, Vec<u32>)>> {
        let r = self.res.lock().map_err(|_| value_err("residency", "poisoned"))?;
        let mut v: Vec<(Vec<u8>, Vec<u32>)> = r.copies().iter().map(|(k, b)| (k.to_bytes(), b.to_vec())).collect();
        v.sort();
        Ok(v)
    }

    /// `record_pending_host_import(request, num_tokens)`.
    fn record_pending_host_import(
        &self,
        request: String,
        #[pyo3(from_py_with = args::num_tokens)] num_tokens: usize,
    ) -> PyResult<()> {
        self.res
            .lock()
            .map_err(|_| value_err("residency", "poisoned"))?
            .record_pending_host_import(&request, num_tokens);
        Ok(())
    }

    /// 0.34's `size_import(request, num_pages)`: the full-sequence host pages of an import
    /// being admitted.
    fn size_import(&self, request: String, #[pyo3(from_py_with = args::num_pages)] num_pages: usize) -> PyResult<()> {
        self.res.lock().map_err(|_| value_err("residency", "poisoned"))?.size_import(&request, num_pages);
        Ok(())
    }

    /// 0.34's `update_import_reservation(request, num_held_pages)`.
    fn update_import_reservation(
        &self,
        request: String,
        #[pyo3(from_py_with = args::num_held_pages)] num_held_pages: usize,
    ) -> PyResult<()> {
        self.res
            .lock()
            .map_err(|_| value_err("residency", "poisoned"))?
            .update_import_reservation(&request, num_held_pages);
        Ok(())
    }

    /// 0.34's `reserved_import_pages`.
    fn reserved_import_pages(&self) -> PyResult<usize> {
        Ok(self.res.lock().map_err(|_| value_err("residency", "poisoned"))?.reserved_import_pages())
    }

    /// `finish_host_import(request, failed=)`.
    fn finish_host_import(&self, py: Python<'_>, request: String, failed: bool) -> PyResult<()> {
        self.run(py, |r, e| r.finish_host_import(e, &request, failed))
    }

    /// `build_row_mirrors([(request, num_computed_tokens, num_scheduled_tokens)])` as
    /// `[(source_starts, destination_start, num_rows)]`.
    #[allow(clippy::type_complexity)]
    fn build_row_mirrors(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::requests_triples)] requests: Vec<(String, usize, usize)>,
    ) -> PyResult<Vec<(Vec<usize>, usize, usize)>> {
        self.run(py, |r, e| {
            Ok(r.build_row_mirrors(e, &requests)
                .into_iter()
                .map(|m| (m.source_starts, m.destination_start, m.num_rows))
                .collect())
        })
    }

    /// `all_context_pages_resident([(request, num_computed_tokens, num_scheduled_tokens)])`.
    fn all_context_pages_resident(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::requests_triples)] requests: Vec<(String, usize, usize)>,
    ) -> PyResult<bool> {
        self.run(py, |r, e| Ok(r.all_context_pages_resident(e, &requests)))
    }

    fn has_pending_work(&self) -> PyResult<bool> {
        Ok(self.res.lock().map_err(|_| value_err("residency", "poisoned"))?.has_pending_work())
    }

    fn has_pending_reclamation(&self, py: Python<'_>) -> PyResult<bool> {
        self.run(py, |r, e| Ok(r.has_pending_reclamation(e)))
    }
}
