//! `BlockPoolCore`'s KV-cache residency metrics: vLLM's `KVCacheMetricsCollector` state kept
//! in the Rust pool (`kvblock.vllm.metrics` reads and drains it).

use super::*;

#[pymethods]
impl PyBlockPool {
    // ---- KV-cache residency metrics (vLLM's metrics_collector; kvblock.vllm.metrics) ----------

    /// Turn residency metrics on: the pool samples the blocks it hands out at `sample_rate`
    /// (a block is sampled iff a uniform draw in [0, 1) is below it, as vLLM's
    /// `random.random() < sample_rate`), from a generator seeded with `seed`; hits and
    /// evictions of sampled blocks are recorded in Rust. Replaces earlier metrics.
    fn _residency_enable(&self, py: Python<'_>, sample_rate: f64, seed: u64) -> PyResult<()> {
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
        let mut me = self.state.borrow_mut(py)?;
        residency_mut(&mut me.inner)?.set_sample_rate(sample_rate);
        Ok(())
    }

    /// The sampled block ids, in vLLM's dict order (`[]` when off).
    fn _residency_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.state.with(py, |me| me.inner.residency().map(|r| r.sampled_ids()).unwrap_or_default())
    }

    /// Number of sampled blocks (0 when off).
    fn _residency_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.residency().map_or(0, |r| r.len()))
    }

    /// A sampled block's state `(birth_time_ns, last_access_ns, access_history)`, or None.
    /// ValueError for an id out of range.
    #[allow(clippy::type_complexity)]
    fn _residency_get(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<Option<(u64, u64, Vec<u64>)>> {
        let me = self.state.borrow(py)?;
        me.inner.check_ids(&[block_id]).py_err()?;
        Ok(me
            .inner
            .residency()
            .and_then(|r| r.get(block_id))
            .map(|s| (s.birth_ns, s.last_access_ns, s.history().to_vec())))
    }

    /// Set a block's state (`block_metrics[id] = state`; of `history`, the last 4 are kept).
    /// ValueError for an id out of range, RuntimeError if metrics are off.
    fn _residency_set(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
        birth_time_ns: u64,
        last_access_ns: u64,
        history: Vec<u64>,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        me.inner.check_ids(&[block_id]).py_err()?;
        let s = crate::pool::residency::Sample::with(birth_time_ns, last_access_ns, &history);
        residency_mut(&mut me.inner)?.set(block_id, s);
        Ok(())
    }

    /// Forget a block's state without an event (`del block_metrics[id]`); False if it had
    /// none. ValueError for an id out of range.
    fn _residency_remove(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<bool> {
        let mut me = self.state.borrow_mut(py)?;
        me.inner.check_ids(&[block_id]).py_err()?;
        Ok(me.inner.residency_mut().is_some_and(|r| r.remove(block_id)))
    }

    /// Forget every sampled block (`block_metrics.clear()`); pending events stay.
    fn _residency_clear(&self, py: Python<'_>) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        if let Some(r) = me.inner.residency_mut() {
            r.clear_samples();
        }
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
        let mut me = self.state.borrow_mut(py)?;
        me.inner.check_ids(&[block_id]).py_err()?;
        let r = residency_mut(&mut me.inner)?;
        let now = crate::pool::residency::now_ns();
        match kind {
            "allocated" => r.on_allocated(block_id, now),
            "accessed" => r.on_accessed(block_id, now),
            "evicted" => r.on_evicted(block_id, now),
            _ => return Err(value_err("kind", format!("{kind:?} is not allocated, accessed or evicted"))),
        }
        Ok(())
    }

    /// The eviction events since the last call, oldest first, as vLLM computes their fields
    /// (nanoseconds / 1e9): appended to `out` as `cls` objects (vLLM's `KVCacheEvictionEvent`,
    /// a dataclass with an instance `__dict__`), made by `cls.__new__(cls)` with
    /// `lifetime_seconds` (float), `idle_seconds` (float) and `reuse_gaps_seconds` (a tuple of
    /// floats) set in their `__dict__`, as its `__init__` sets them. Returns how many.
    fn _residency_take_events(
        &self,
        py: Python<'_>,
        cls: &Bound<'_, PyAny>,
        out: &Bound<'_, PyList>,
    ) -> PyResult<usize> {
        let events = {
            let mut me = self.state.borrow_mut(py)?;
            me.inner.residency_mut().map(|r| r.take_events()).unwrap_or_default()
        };
        let s = |ns: u64| ns as f64 / 1e9;
        let new = cls.getattr(pyo3::intern!(py, "__new__"))?;
        let (life, idle, gaps) = (
            pyo3::intern!(py, "lifetime_seconds"),
            pyo3::intern!(py, "idle_seconds"),
            pyo3::intern!(py, "reuse_gaps_seconds"),
        );
        let dict_name = pyo3::intern!(py, "__dict__");
        for e in &events {
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

    /// Number of eviction events not taken yet (0 when off).
    fn _residency_num_pending(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.residency().map_or(0, |r| r.num_pending_events()))
    }
}

/// The pool's residency metrics, or RuntimeError when they are off.
fn residency_mut(pool: &mut BlockPool) -> PyResult<&mut crate::pool::residency::Residency> {
    pool.residency_mut()
        .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("this pool records no residency metrics"))
}
