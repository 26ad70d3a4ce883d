//! `KVCacheManagerCore`'s HiSparse host pool residency metrics: the `_residency_*` calls of
//! `BlockPoolCore` (`crate::py::block_pool::residency::ops`) on the host pool the manager's
//! HiSparse tier holds, for `kvblock.vllm.hisparse.HostBlockPool`'s `metrics_collector` (vLLM's
//! `bind_host_pool` gives its host pool a `KVCacheMetricsCollector` of its own), and the host
//! pool's `reset_prefix_cache` (which resets them). Thin: every call is the pool's; a manager
//! without HiSparse groups raises `RuntimeError`.

use super::hisparse::no_hisparse;
use super::*;
use crate::hisparse::residency::Env;
use crate::pool::block_pool::BlockPool;
use crate::py::block_pool::residency::ops;

impl PyManager {
    /// Run `f` on the HiSparse host pool (after the tier's usual drain of reuse watchers).
    fn host_pool<R>(&self, py: Python<'_>, f: impl FnOnce(&mut BlockPool) -> PyResult<R>) -> PyResult<R> {
        let mut out = None;
        self.residency(py, |_, e| {
            out = Some(f(e.host()));
            Ok(())
        })?;
        out.unwrap_or_else(|| Err(no_hisparse()))
    }
}

#[pymethods]
impl PyManager {
    /// The host pool's `reset_prefix_cache()`: every cache key cleared (its residency metrics
    /// reset, an `AllBlocksCleared` event into the device pool's queue when events are on) if
    /// no host block is in use; False, changing nothing, otherwise.
    fn _hisparse_host_reset_prefix_cache(&self, py: Python<'_>) -> PyResult<bool> {
        self.host_pool(py, |h| Ok(h.reset_prefix_cache()))
    }

    /// Turn residency metrics on for the host pool (`_residency_enable`): sampled at
    /// `sample_rate` from a generator seeded with `seed`. Replaces earlier host metrics.
    fn _hisparse_host_residency_enable(
        &self,
        py: Python<'_>,
        sample_rate: f64,
        #[pyo3(from_py_with = crate::py::args::seed)] seed: u64,
    ) -> PyResult<()> {
        self.host_pool(py, |h| h.enable_residency(sample_rate, seed).py_err())
    }

    /// Whether the host pool records residency metrics.
    fn _hisparse_host_residency_on(&self, py: Python<'_>) -> PyResult<bool> {
        self.host_pool(py, |h| Ok(h.residency().is_some()))
    }

    /// Set the host pool's sample rate (any float). RuntimeError if its metrics are off.
    fn _hisparse_host_residency_set_rate(&self, py: Python<'_>, sample_rate: f64) -> PyResult<()> {
        self.host_pool(py, |h| ops::set_rate(h, sample_rate))
    }

    /// The host pool's sampled block ids, in vLLM's dict order (`[]` when off).
    fn _hisparse_host_residency_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.host_pool(py, |h| Ok(ops::ids(h)))
    }

    /// Number of sampled host blocks (0 when off).
    fn _hisparse_host_residency_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.host_pool(py, |h| Ok(ops::len(h)))
    }

    /// A sampled host block's state `(birth_time_ns, last_access_ns, access_history)`, or
    /// None. ValueError for an id outside the host pool.
    #[allow(clippy::type_complexity)]
    fn _hisparse_host_residency_get(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<Option<(u64, u64, Vec<u64>)>> {
        self.host_pool(py, |h| ops::get(h, block_id))
    }

    /// Set a host block's state (of `history`, the last 4 are kept). ValueError for an id
    /// outside the host pool, RuntimeError if its metrics are off; nothing changes then.
    fn _hisparse_host_residency_set(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
        #[pyo3(from_py_with = crate::py::args::birth_time_ns)] birth_time_ns: u64,
        #[pyo3(from_py_with = crate::py::args::last_access_ns)] last_access_ns: u64,
        #[pyo3(from_py_with = crate::py::args::history)] history: Vec<u64>,
    ) -> PyResult<()> {
        self.host_pool(py, |h| ops::set(h, block_id, birth_time_ns, last_access_ns, &history))
    }

    /// Forget a host block's state without an event; False if it had none. ValueError for an
    /// id outside the host pool.
    fn _hisparse_host_residency_remove(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<bool> {
        self.host_pool(py, |h| ops::remove(h, block_id))
    }

    /// Forget every sampled host block; pending events stay.
    fn _hisparse_host_residency_clear(&self, py: Python<'_>) -> PyResult<()> {
        self.host_pool(py, |h| {
            ops::clear(h);
            Ok(())
        })
    }

    /// A collector hook on a host block (`kind`: "allocated", "accessed" or "evicted").
    /// ValueError for another kind or an id outside the host pool, RuntimeError if its
    /// metrics are off; nothing changes then.
    fn _hisparse_host_residency_hook(
        &self,
        py: Python<'_>,
        kind: &str,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<()> {
        self.host_pool(py, |h| ops::hook(h, kind, block_id))
    }

    /// The host pool's eviction events since the last call, oldest first, appended to `out`
    /// as `cls` objects (vLLM's `KVCacheEvictionEvent`, as `BlockPoolCore._residency_take_events`
    /// makes them). Returns how many.
    fn _hisparse_host_residency_take_events(
        &self,
        py: Python<'_>,
        cls: &Bound<'_, PyAny>,
        out: &Bound<'_, PyList>,
    ) -> PyResult<usize> {
        let events = self.host_pool(py, |h| Ok(ops::take_events(h)))?;
        ops::append_events(py, &events, cls, out)
    }

    /// Number of host eviction events not taken yet (0 when off).
    fn _hisparse_host_residency_num_pending(&self, py: Python<'_>) -> PyResult<usize> {
        self.host_pool(py, |h| Ok(ops::num_pending(h)))
    }
}
