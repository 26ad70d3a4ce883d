//! The pool's KV events as they cross into Python before their vLLM objects are built: named,
//! frozen records (`RawBlockStored`, `RawBlockRemoved`, `RawAllBlocksCleared`), one per
//! [`crate::pool::Event`], so the Python side reads fields by name, not tuple positions.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// Blocks were cached (vLLM's `BlockStored`, before its extra keys and token ids are read
/// from the request).
#[pyclass(module = "kvblock._core", frozen, get_all)]
pub struct RawBlockStored {
    /// The new blocks' digests (`list[bytes]`), in block order.
    pub block_hashes: Py<PyList>,
    /// The digest of the block before the first one, or None.
    pub parent_block_hash: Option<Py<PyBytes>>,
    /// The event's token ids are the request's `all_token_ids[token_start:token_end]`.
    pub token_start: usize,
    pub token_end: usize,
    /// The event's `block_size`.
    pub block_size: usize,
    /// The KV-cache group.
    pub group: u32,
    /// The request the blocks belong to (or the snapshot standing for it), None if unknown.
    pub request: Option<Py<PyAny>>,
    /// `[(start, end), ...]`: each block's token range (its extra keys come from there).
    pub key_ranges: Vec<(usize, usize)>,
    /// `(token ids, offset)` copied when the blocks were cached, or None: read the request.
    pub tokens: Option<(Py<PyAny>, usize)>,
    /// The blocks are on the host pool whose events share this pool's queue (HiSparse's
    /// host tier: vLLM's `medium` "CPU"); False: this pool's own medium.
    pub host: bool,
}

#[pymethods]
impl RawBlockStored {
    /// `"stored"`.
    #[getter]
    fn kind(&self) -> &'static str {
        "stored"
    }
}

/// A cached block lost a key (vLLM's `BlockRemoved`, one per key).
#[pyclass(module = "kvblock._core", frozen, get_all)]
pub struct RawBlockRemoved {
    /// The removed digest.
    pub block_hash: Py<PyBytes>,
    /// The KV-cache group.
    pub group: u32,
    /// The block was on the host pool whose events share this pool's queue (vLLM's `medium`
    /// "CPU"); False: this pool's own medium.
    pub host: bool,
}

#[pymethods]
impl RawBlockRemoved {
    /// `"removed"`.
    #[getter]
    fn kind(&self) -> &'static str {
        "removed"
    }
}

/// Every cached block lost its key (vLLM's `AllBlocksCleared`).
#[pyclass(module = "kvblock._core", frozen)]
pub struct RawAllBlocksCleared;

#[pymethods]
impl RawAllBlocksCleared {
    /// `"cleared"`.
    #[getter]
    fn kind(&self) -> &'static str {
        "cleared"
    }
}
