//! `BlockPoolCore`'s reset and unpinning, the blocks' own fields, the block-hash map and the
//! raw free queue: what vLLM's `BlockPool` object API and kvblock's tests read and set.

use super::*;

#[pymethods]
impl PyBlockPool {
    /// Clear every cache key if no block is in use (vLLM `reset_prefix_cache`); False, with no
    /// change, while any non-null block is allocated.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<bool> {
        let mut me = self.state.borrow_mut(py)?;
        Ok(me.inner.reset_prefix_cache())
    }

    /// `move_block_hashes(src_block, dst_block)` on ids. Raises ValueError naming the
    /// argument, changing nothing, for an id out of range or `dst` the null block (which never
    /// holds a key); AssertionError (vLLM's) if `dst` has a key.
    fn move_block_hash_ids(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::src)] src: u32,
        #[pyo3(from_py_with = crate::py::args::dst)] dst: u32,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        me.inner.move_block_hashes(src, dst).py_err()
    }

    /// `unpin_blocks` on ids: drop a reference on each; blocks reaching 0 join the tail of the
    /// free queue; `watcher` (the caller's id for its callback) fires when the pool reuses
    /// them (`_take_fired_watchers`).
    fn unpin_ids(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::py::args::watcher)] watcher: u64,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let ids = block_ids_of(ids, "blocks")?;
        me.inner.unpin_blocks(&ids, watcher).py_err()
    }

    /// The `(block id, watcher id)` pairs of the Python reuse watchers that fired since the
    /// last call. The HiSparse residency's own entries (`RESIDENCY_WATCHER`) stay in the pool
    /// for the manager that holds the residency, which drains them at its next call.
    fn _take_fired_watchers(&self, py: Python<'_>) -> PyResult<Vec<(u32, u64)>> {
        let watcher = crate::hisparse::residency::RESIDENCY_WATCHER;
        Ok(self.state.borrow_mut(py)?.inner.take_fired_watchers_except(watcher))
    }

    /// The recorded reuse watchers, `[(block id, watcher id), ...]` in registration order;
    /// the HiSparse residency's own entries have None for a watcher id.
    fn _watched_blocks(&self, py: Python<'_>) -> PyResult<Vec<(u32, Option<u64>)>> {
        let residency = crate::hisparse::residency::RESIDENCY_WATCHER;
        self.state.with(py, |me| {
            me.inner.watched_blocks().into_iter().map(|(b, w)| (b, (w != residency).then_some(w))).collect()
        })
    }

    /// True if reuse watchers are recorded.
    fn _has_watchers(&self, py: Python<'_>) -> PyResult<bool> {
        self.state.with(py, |me| me.inner.has_watchers())
    }

    // ---- inspection and the blocks' own fields -----------------------------------------------

    /// A block's reference count (`KVCacheBlock.ref_cnt`). Raises ValueError for an id
    /// outside `[0, num_gpu_blocks)`.
    fn ref_cnt(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<u32> {
        let me = self.state.borrow(py)?;
        me.inner.ref_cnt(block_id).py_err()
    }

    /// Set a block's reference count (vLLM code writing `block.ref_cnt`): only between
    /// positive values, or to 0 for a block in the free queue (RuntimeError otherwise).
    fn set_ref_cnt(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
        value: i64,
    ) -> PyResult<()> {
        let v = u32::try_from(value).map_err(|_| value_err("ref_cnt", format!("{value} is out of range")))?;
        self.state.borrow_mut(py)?.inner.set_ref_cnt(block_id, v).py_err()
    }

    /// A block's `BlockHashWithGroupId` (hash + 4-byte big-endian group), or None.
    fn block_hash<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let key = self.state.with(py, |me| me.inner.block_key(block_id))?.py_err()?;
        Ok(key.map(|k| key_bytes(py, &k)))
    }

    /// A block's `block_hash_num_tokens` (the prefix length its key covers), or None.
    fn block_hash_num_tokens(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<Option<usize>> {
        self.state.with(py, |me| me.inner.block_hash_num_tokens(block_id))?.py_err()
    }

    /// `block.set_block_hash(key, num_tokens)`: give a block without a hash a key (not in the
    /// map until inserted). AssertionError if it has one; ValueError for the null block.
    #[pyo3(signature = (block_id, key, num_tokens=None))]
    fn set_block_hash(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
        key: &Bound<'_, PyAny>,
        num_tokens: Option<i64>,
    ) -> PyResult<()> {
        let key = key_arg(key)?;
        let t = opt_tokens(num_tokens, "num_tokens")?;
        self.state.borrow_mut(py)?.inner.set_block_hash(block_id, key, t).py_err()
    }

    /// `block.reset_hash()`: the block forgets its key.
    fn reset_hash(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<()> {
        self.state.borrow_mut(py)?.inner.reset_hash(block_id).py_err()
    }

    /// The further keys of a block (vLLM's `cached_block_hashes_by_block[block_id]`).
    fn secondary_keys<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let keys = self.state.with(py, |me| me.inner.secondary_keys(block_id))?;
        Ok(keys.iter().map(|k| key_bytes(py, k)).collect())
    }

    /// `{block_id: [further keys]}` for every block that has further keys.
    fn secondary_items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let items = self.state.with(py, |me| me.inner.secondary_items())?;
        let d = PyDict::new(py);
        for (b, keys) in items {
            let ks: Vec<Bound<'py, PyBytes>> = keys.iter().map(|k| key_bytes(py, k)).collect();
            d.set_item(b, ks)?;
        }
        Ok(d)
    }

    /// `is_block_writable(block)` on an id.
    fn is_block_writable(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<bool> {
        self.state.with(py, |me| me.inner.is_block_writable(block_id))?.py_err()
    }

    /// True if the block is in the free queue.
    fn is_free(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<bool> {
        let me = self.state.borrow(py)?;
        me.inner.ref_cnt(block_id).py_err()?;
        Ok(me.inner.is_free(block_id))
    }

    /// A block's free-queue neighbours `(prev, next, linked)`: ids, None at an end (a
    /// sentinel), and whether the block is in the queue.
    fn queue_neighbours(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<(Option<u32>, Option<u32>, bool)> {
        let me = self.state.borrow(py)?;
        me.inner.ref_cnt(block_id).py_err()?;
        Ok(me.inner.queue_neighbours(block_id))
    }

    /// The first and last free blocks (None when the queue is empty).
    fn queue_ends(&self, py: Python<'_>) -> PyResult<(Option<u32>, Option<u32>)> {
        self.state.with(py, |me| me.inner.queue_ends())
    }

    /// The free queue's block ids, head (next to allocate) first.
    fn free_queue_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.state.with(py, |me| me.inner.free_queue().collect())
    }

    /// Number of keys in the hash -> block map.
    fn num_cached_keys(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.cache_map().len())
    }

    /// The hash -> block map as `{BlockHashWithGroupId: [block ids in insertion order]}`.
    fn cached_items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let me = self.state.borrow(py)?;
        let d = PyDict::new(py);
        for (k, blocks) in me.inner.cache_map().iter() {
            d.set_item(key_bytes(py, &k), blocks)?;
        }
        Ok(d)
    }

    /// `{key: (block ids, held two blocks at once)}`: the map as vLLM's dict shapes it (a
    /// key that has held two blocks keeps a dict of them).
    fn cached_entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let me = self.state.borrow(py)?;
        let d = PyDict::new(py);
        for (k, blocks, multi) in me.inner.cache_map().entries() {
            d.set_item(key_bytes(py, &k), (blocks, multi))?;
        }
        Ok(d)
    }

    /// A key's `(block ids, held two blocks at once)`, or None.
    fn lookup_key_entry(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<(Vec<u32>, bool)>> {
        let key = key_arg(key)?;
        self.state.with(py, |me| {
            let m = me.inner.cache_map();
            m.find(&key).map(|s| (m.blocks_of_slot(s), m.is_multi(s)))
        })
    }

    /// The first block cached under a `BlockHashWithGroupId` key, or None.
    fn lookup_key(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let key = key_arg(key)?;
        self.state.with(py, |me| me.inner.lookup(&key.hash, key.group))
    }

    /// Every block cached under a `BlockHashWithGroupId` key, in insertion order.
    fn lookup_key_all(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let key = key_arg(key)?;
        self.state.with(py, |me| me.inner.cache_map().get_all(&key))
    }

    /// `cached_block_hash_to_block.insert(key, block)` on an id. Raises ValueError naming
    /// `block_id`, changing nothing, for the null block (which never holds a key).
    fn map_insert(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<()> {
        let key = key_arg(key)?;
        self.state.borrow_mut(py)?.inner.map_insert(key, block_id).py_err()
    }

    /// `cached_block_hash_to_block.pop(key, block_id)`: True if the block was under the key.
    fn map_pop(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<bool> {
        let key = key_arg(key)?;
        self.state.borrow_mut(py)?.inner.map_pop(key, block_id).py_err()
    }

    /// Take a key out of the map, its blocks keeping it (`_cache.pop(key)`); its block ids.
    fn map_detach(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let key = key_arg(key)?;
        Ok(self.state.borrow_mut(py)?.inner.map_detach(&key))
    }

    /// Take every key out of the map (`_cache.clear()`).
    fn map_detach_all(&self, py: Python<'_>) -> PyResult<()> {
        self.state.borrow_mut(py)?.inner.map_detach_all();
        Ok(())
    }

    /// Restore a key taken out with `map_detach`, with the blocks it had.
    fn map_reattach(&self, py: Python<'_>, key: &Bound<'_, PyAny>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = key_arg(key)?;
        let block_ids = block_ids_of(block_ids, "block_ids")?;
        self.state.borrow_mut(py)?.inner.map_reattach(&key, &block_ids).py_err()
    }

    /// Check internal invariants; raises RuntimeError on a violation (for tests).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let me = self.state.borrow(py)?;
        me.inner.check_invariants().py_err()
    }

    // ---- raw free-queue access (vLLM's FreeKVCacheBlockQueue, no ref counting) ---------------

    fn _queue_popleft_n(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::n)] n: i64,
    ) -> PyResult<Vec<u32>> {
        let mut me = self.state.borrow_mut(py)?;
        if n < 0 {
            return Err(value_err("n", "must be >= 0"));
        }
        let mut out = Vec::new();
        me.inner.queue_popleft_n(n as usize, &mut out).py_err()?;
        Ok(out)
    }

    fn _queue_remove(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        me.inner.queue_remove(block_id).py_err()
    }

    fn _queue_insert(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, at_head: bool) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let ids = block_ids_of(ids, "blocks")?;
        me.inner.queue_insert(&ids, at_head).py_err()
    }
}
