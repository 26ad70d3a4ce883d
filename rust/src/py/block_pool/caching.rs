//! `BlockPoolCore` caching a request's blocks (the facade's vLLM methods) and handing out
//! the KV events they raise.

use super::*;
use crate::pool::events::Medium;
use crate::py::fields::Field;
use crate::py::raw_events::{RawAllBlocksCleared, RawBlockRemoved, RawBlockStored};

#[pymethods]
impl PyBlockPool {
    // ---- caching for a request (the facade's vLLM methods) --------------------------------

    /// `cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
    /// kv_cache_group_id, block_mask)` on the table's ids: the request's hashes are viewed at
    /// `block_size`; `block_mask` (aligned with the range) skips blocks. With `distinct`
    /// (kvblock's own API) a block listed twice in the range is a ValueError naming `blocks`,
    /// nothing changed and no event; without it (vLLM's), the later listing promotes the key
    /// the earlier one gave, as vLLM's `cache_full_blocks` does.
    #[pyo3(signature = (request, block_ids, num_cached_blocks, num_full_blocks, block_size, group_id, block_mask=None, distinct=false))]
    #[allow(clippy::too_many_arguments)] // the facade's cache_full_blocks arguments
    fn _cache_full_blocks(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::py::args::num_cached_blocks)] num_cached_blocks: usize,
        #[pyo3(from_py_with = crate::py::args::num_full_blocks)] num_full_blocks: usize,
        #[pyo3(from_py_with = crate::py::args::block_size_count)] block_size: usize,
        #[pyo3(from_py_with = crate::py::args::group_id)] group_id: u32,
        block_mask: Option<Vec<bool>>,
        distinct: bool,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        if num_cached_blocks >= num_full_blocks {
            return Ok(());
        }
        let ids = block_ids_of(block_ids, "blocks")?;
        if distinct {
            let mask = block_mask.as_deref();
            me.inner.check_distinct_blocks(&ids, num_cached_blocks, num_full_blocks, mask, "blocks").py_err()?;
        }
        let hashes = PyHashes::of(request.getattr(Field::BlockHashes.interned(py))?, "request.block_hashes")?;
        let view = ScaledHashes::new(&hashes, me.inner.hash_block_size(), block_size).py_err()?;
        let end = num_full_blocks.min(ids.len().max(num_cached_blocks));
        hashes.check(num_cached_blocks.saturating_sub(1) * view.scale(), end * view.scale())?;
        let inputs = if me.inner.events_enabled() && !request.is_none() {
            Some(EventInputs::read(RequestFields::of_kvblock_request(py)?, request, None)?)
        } else {
            None
        };
        me.tagged(request, inputs.as_ref(), |pool, tag| {
            pool.cache_full_blocks(
                &ids,
                num_cached_blocks,
                end,
                &view,
                block_size,
                group_id,
                block_mask.as_deref(),
                tag,
            )
        })
        .py_err()
    }

    /// `cache_partial_block(request, block, num_tokens, kv_cache_group_id, block_size,
    /// replace_existing_hashes)` on an id: the key registered, or None for the null block.
    #[pyo3(signature = (request, block_id, num_tokens, group_id, block_size, replace_existing_hashes=false))]
    #[allow(clippy::too_many_arguments)] // vLLM's arguments
    fn _cache_partial_block<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = crate::py::args::block_id_u32)] block_id: u32,
        #[pyo3(from_py_with = crate::py::args::num_full_blocks)] num_tokens: usize,
        #[pyo3(from_py_with = crate::py::args::group_id)] group_id: u32,
        #[pyo3(from_py_with = crate::py::args::block_size_count)] block_size: usize,
        replace_existing_hashes: bool,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let mut me = self.state.borrow_mut(py)?;
        let hashes = PyHashes::of(request.getattr(Field::BlockHashes.interned(py))?, "request.block_hashes")?;
        let h = me.inner.hash_block_size();
        hashes.check((num_tokens / h).saturating_sub(2), num_tokens / h)?;
        let inputs = if me.inner.events_enabled() {
            Some(EventInputs::read(RequestFields::of_kvblock_request(py)?, request, None)?)
        } else {
            None
        };
        let key = me
            .tagged(request, inputs.as_ref(), |pool, tag| {
                pool.cache_partial_block(
                    block_id,
                    &hashes,
                    num_tokens,
                    group_id,
                    block_size,
                    replace_existing_hashes,
                    tag,
                )
            })
            .py_err()?;
        Ok(key.map(|k| key_bytes(py, &k)))
    }

    /// `emit_cached_block_events(request, num_cached_blocks, block_size, kv_cache_group_id)`.
    fn _emit_cached_block_events(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::py::args::num_cached_blocks)] num_cached_blocks: usize,
        #[pyo3(from_py_with = crate::py::args::block_size_count)] block_size: usize,
        #[pyo3(from_py_with = crate::py::args::group_id)] group_id: u32,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        if !me.inner.events_enabled() || num_cached_blocks == 0 {
            return Ok(());
        }
        let hashes = PyHashes::of(request.getattr(Field::BlockHashes.interned(py))?, "request.block_hashes")?;
        let view = ScaledHashes::new(&hashes, me.inner.hash_block_size(), block_size).py_err()?;
        hashes.check(0, num_cached_blocks * view.scale())?;
        let inputs = EventInputs::read(RequestFields::of_kvblock_request(py)?, request, None)?;
        me.tagged(request, Some(&inputs), |pool, tag| {
            pool.emit_cached_block_events(&view, num_cached_blocks, block_size, group_id, tag)
        })
        .py_err()
    }

    /// Drain the raw events, oldest first, as named records: `RawBlockStored` (its token ids
    /// as they were when cached, when the request's list was known), `RawBlockRemoved`,
    /// `RawAllBlocksCleared` (see `rust/src/py/raw_events.rs`).
    fn take_raw_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut me = self.state.borrow_mut(py)?;
        let out = PyList::empty(py);
        for e in me.inner.take_events() {
            match e {
                Event::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_start,
                    token_end,
                    block_size,
                    group,
                    key_ranges,
                    tag,
                    medium,
                } => {
                    let hs = PyList::new(py, block_hashes.iter().map(|d| PyBytes::new(py, d.as_bytes())))?;
                    let (request, tokens) = match me.tags.get(&tag) {
                        // the snapshot stands for the request (the event reads only those)
                        Some((r, t, ns)) => (
                            Some(ns.as_ref().map(|n| n.clone_ref(py)).unwrap_or_else(|| r.clone_ref(py))),
                            t.as_ref().map(|(l, lo)| (l.clone_ref(py).into_any(), *lo)),
                        ),
                        None => (None, None),
                    };
                    let record = RawBlockStored {
                        block_hashes: hs.unbind(),
                        parent_block_hash: parent_block_hash.map(|d| PyBytes::new(py, d.as_bytes()).unbind()),
                        token_start,
                        token_end,
                        block_size,
                        group,
                        request,
                        key_ranges,
                        tokens,
                        host: medium == Medium::Host,
                    };
                    out.append(Bound::new(py, record)?)?;
                }
                Event::BlockRemoved { block_hash, group, medium } => {
                    let record = RawBlockRemoved {
                        block_hash: PyBytes::new(py, block_hash.as_bytes()).unbind(),
                        group,
                        host: medium == Medium::Host,
                    };
                    out.append(Bound::new(py, record)?)?;
                }
                Event::AllBlocksCleared => out.append(Bound::new(py, RawAllBlocksCleared)?)?,
            }
        }
        // No event is pending any more, so no tag can be referred to but those of the
        // HiSparse publications still owed.
        me.forget_taken_tags();
        Ok(out)
    }

    /// The null block's id (0).
    #[getter]
    fn null_block_id(&self) -> u32 {
        NULL_BLOCK
    }
}
