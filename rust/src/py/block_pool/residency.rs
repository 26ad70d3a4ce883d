//! `BlockPoolCore`'s KV-cache residency metrics: vLLM's `KVCacheMetricsCollector` state kept
//! in the Rust pool (`kvblock.vllm.metrics` reads and drains it). The free functions ([`ops`])
//! work on any core pool: the manager binding runs them on HiSparse's host pool too.

use super::*;

/// The residency calls on a core pool, shared by `BlockPoolCore` and the manager binding's
/// HiSparse host pool calls (`_hisparse_host_residency_*`). Each checks its ids first and
/// changes nothing on error.
pub(crate) mod ops {
    use super::*;

    /// The pool's residency metrics, or RuntimeError when they are off.
    fn residency_mut(pool: &mut BlockPool) -> PyResult<&mut crate::pool::residency::Residency> {
        pool.residency_mut()
            .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("this pool records no residency metrics"))
    }

    pub fn set_rate(pool: &mut BlockPool, sample_rate: f64) -> PyResult<()> {
        residency_mut(pool)?.set_sample_rate(sample_rate);
        Ok(())
    }

    pub fn ids(pool: &BlockPool) -> Vec<u32> {
        pool.residency().map(|r| r.sampled_ids()).unwrap_or_default()
    }

    pub fn len(pool: &BlockPool) -> usize {
        pool.residency().map_or(0, |r| r.len())
    }

    #[allow(clippy::type_complexity)]
    pub fn get(pool: &BlockPool, block_id: u32) -> PyResult<Option<(u64, u64, Vec<u64>)>> {
        pool.check_ids(&[block_id]).py_err()?;
        Ok(pool.residency().and_then(|r| r.get(block_id)).map(|s| (s.birth_ns, s.last_access_ns, s.history().to_vec())))
    }

    pub fn set(
        pool: &mut BlockPool,
        block_id: u32,
        birth_ns: u64,
        last_access_ns: u64,
        history: &[u64],
    ) -> PyResult<()> {
        pool.check_ids(&[block_id]).py_err()?;
        let s = crate::pool::residency::Sample::with(birth_ns, last_access_ns, history);
        residency_mut(pool)?.set(block_id, s);
        Ok(())
    }

    pub fn remove(pool: &mut BlockPool, block_id: u32) -> PyResult<bool> {
        pool.check_ids(&[block_id]).py_err()?;
        Ok(pool.residency_mut().is_some_and(|r| r.remove(block_id)))
    }

    pub fn clear(pool: &mut BlockPool) {
        if let Some(r) = pool.residency_mut() {
            r.clear_samples();
        }
    }

    pub fn hook(pool: &mut BlockPool, kind: &str, block_id: u32) -> PyResult<()> {
        pool.check_ids(&[block_id]).py_err()?;
        if !matches!(kind, "allocated" | "accessed" | "evicted") {
            return Err(value_err("kind", format!("{kind:?} is not allocated, accessed or evicted")));
        }
        let r = residency_mut(pool)?;
        let now = crate::pool::residency::now_ns();
        match kind {
            "allocated" => r.on_allocated(block_id, now),
            "accessed" => r.on_accessed(block_id, now),
            _ => r.on_evicted(block_id, now),
        }
        Ok(())
    }

    pub fn take_events(pool: &mut BlockPool) -> Vec<crate::pool::residency::EvictionEvent> {
        pool.residency_mut().map(|r| r.take_events()).unwrap_or_default()
    }

    pub fn num_pending(pool: &BlockPool) -> usize {
        pool.residency().map_or(0, |r| r.num_pending_events())
    }

    /// Append `events` to `out` as `cls` objects (vLLM's `KVCacheEvictionEvent`, a dataclass
    /// with an instance `__dict__`), made by `cls.__new__(cls)` with `lifetime_seconds`
    /// (float), `idle_seconds` (float) and `reuse_gaps_seconds` (a tuple of floats) set in
    /// their `__dict__`, as its `__init__` sets them (nanoseconds / 1e9). Returns how many.
    pub fn append_events(
        py: Python<'_>,
        events: &[crate::pool::residency::EvictionEvent],
        cls: &Bound<'_, PyAny>,
        out: &Bound<'_, PyList>,
    ) -> PyResult<usize> {
        let s = |ns: u64| ns as f64 / 1e9;
        let new = cls.getattr(pyo3::intern!(py, "__new__"))?;
        let (life, idle, gaps) = (
            pyo3::intern!(py, "lifetime_seconds"),
            pyo3::intern!(py, "idle_seconds"),
            pyo3::intern!(py, "reuse_gaps_seconds"),
        );
        let dict_name = pyo3::intern!(py, "__dict__");
        for e in events {
            let obj = new.call1((cls,))?;
            let d = obj.getattr(dict_name)?;
            let d = d.cast::<PyDict>()?;
            d.set_item(life, s(e.lifetime_ns))?;
            d.set_item(idle, s(e.idle_ns))?;
            d.set_item(gaps, PyTuple::new(py, e.reuse_gaps_ns().iter().map(|&g| s(g)))?)?;
            out.append(obj)?;
        }
        Ok(events.len())
    }
}

#[pymethods]
impl PyBlockPool {
    // ---- KV-cache residency metrics (vLLM's metrics_collector; kvblock.vllm.metrics) ----------

    /// Turn residency metrics on: the pool samples the blocks it hands out at `sample_rate`
    /// (a block is sampled iff a uniform draw in [0, 1) is below it, as vLLM's
    /// `random.random() < sample_rate`), from a generator seeded with `seed`; hits and
    /// evictions of sampled blocks are recorded in Rust. Replaces earlier metrics.
    fn _residency_enable(
        &self,
        py: Python<'_>,
        sample_rate: f64,
        #[pyo3(from_py_with = crate::py::args::seed)] seed: u64,
    ) -> PyResult<()> {
        self.state.borrow_mut(py)?.inner.enable_residency(sample_rate, seed).py_err()
    }

    /// Turn residency metrics off, dropping their state.
    fn _residency_disable(&self, py: Python<'_>) -> PyResult<()> {
        self.state.borrow_mut(py)?.inner.disable_residency();
        Ok(())
    }

    /// Whether residency metrics are on.
    fn _residency_on(&self, py: Python<'_>) -> PyResult<bool> {
        self.state.with(py, |me| me.inner.residency().is_some())
    }

    /// Set the sample rate (any float). RuntimeError if metrics are off.
    fn _residency_set_rate(&self, py: Python<'_>, sample_rate: f64) -> PyResult<()> {
        ops::set_rate(&mut self.state.borrow_mut(py)?.inner, sample_rate)
    }

    /// The sampled block ids, in vLLM's dict order (`[]` when off).
    fn _residency_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.state.with(py, |me| ops::ids(&me.inner))
    }

    /// Number of sampled blocks (0 when off).
    fn _residency_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| ops::len(&me.inner))
    }

    /// A sampled block's state `(birth_time_ns, last_access_ns, access_history)`, or None.
    /// ValueError for an id out of range.
    #[allow(clippy::type_complexity)]
    fn _residency_get(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<Option<(u64, u64, Vec<u64>)>> {
        ops::get(&self.state.borrow(py)?.inner, block_id)
    }

    /// Set a block's state (`block_metrics[id] = state`; of `history`, the last 4 are kept).
    /// ValueError for an id out of range, RuntimeError if metrics are off.
    fn _residency_set(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
        #[pyo3(from_py_with = crate::py::args::birth_time_ns)] birth_time_ns: u64,
        #[pyo3(from_py_with = crate::py::args::last_access_ns)] last_access_ns: u64,
        #[pyo3(from_py_with = crate::py::args::history)] history: Vec<u64>,
    ) -> PyResult<()> {
        ops::set(&mut self.state.borrow_mut(py)?.inner, block_id, birth_time_ns, last_access_ns, &history)
    }

    /// Forget a block's state without an event (`del block_metrics[id]`); False if it had
    /// none. ValueError for an id out of range.
    fn _residency_remove(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<bool> {
        ops::remove(&mut self.state.borrow_mut(py)?.inner, block_id)
    }

    /// Forget every sampled block (`block_metrics.clear()`); pending events stay.
    fn _residency_clear(&self, py: Python<'_>) -> PyResult<()> {
        ops::clear(&mut self.state.borrow_mut(py)?.inner);
        Ok(())
    }

    /// One of the collector's hooks on a block, from outside the pool's transitions:
    /// `kind` is "allocated", "accessed" or "evicted" (vLLM's `on_block_<kind>`), at the clock
    /// of `time.monotonic_ns`. ValueError for another kind or an id out of range,
    /// RuntimeError if metrics are off.
    fn _residency_hook(
        &self,
        py: Python<'_>,
        kind: &str,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<()> {
        ops::hook(&mut self.state.borrow_mut(py)?.inner, kind, block_id)
    }

    /// The eviction events since the last call, oldest first, appended to `out` as `cls`
    /// objects ([`ops::append_events`]). Returns how many.
    fn _residency_take_events(
        &self,
        py: Python<'_>,
        cls: &Bound<'_, PyAny>,
        out: &Bound<'_, PyList>,
    ) -> PyResult<usize> {
        let events = ops::take_events(&mut self.state.borrow_mut(py)?.inner);
        ops::append_events(py, &events, cls, out)
    }

    /// Number of eviction events not taken yet (0 when off).
    fn _residency_num_pending(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| ops::num_pending(&me.inner))
    }
}
