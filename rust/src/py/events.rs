//! What a `BlockStored` KV event reports about its request, taken when the blocks are cached.
//!
//! vLLM builds the event while it caches the blocks. kvblock buffers events in the Rust pool
//! and builds the Python objects when they are taken, so the request's token ids and the
//! fields its extra keys come from are read before the caching call (nothing can fail once it
//! has changed the pool) and copied right after it.

use super::fields::{Field, RequestFields};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// What a `BlockStored` event reports about its request, read before the caching call
/// changes anything: vLLM builds the event when it caches the blocks, so later changes to the
/// request must not show in it.
pub struct EventInputs<'py> {
    /// The request's token list (a copy when its token sequence is not a list).
    tokens: Option<Bound<'py, PyList>>,
    /// `lora_request`, `mm_features`, `cache_salt`, `prompt_embeds`,
    /// `_prompt_embeds_per_block_hashes`, `session_id`, `prompt_is_token_ids` (None where the
    /// request has no such attribute).
    fields: [Option<Bound<'py, PyAny>>; 7],
}

const EVENT_FIELDS: [(Field, &str); 7] = [
    (Field::LoraRequest, "lora_request"),
    (Field::MmFeatures, "mm_features"),
    (Field::CacheSalt, "cache_salt"),
    (Field::PromptEmbeds, "prompt_embeds"),
    (Field::PromptEmbedsBlockHashes, "_prompt_embeds_per_block_hashes"),
    (Field::SessionId, "session_id"),
    (Field::PromptIsTokenIds, "prompt_is_token_ids"),
];

impl<'py> EventInputs<'py> {
    /// Read them from `request`; `tokens` is its token list when the caller has it (else
    /// `request.all_token_ids` is read, and copied unless it is a list). Errors other than
    /// a missing attribute propagate.
    pub fn read(
        fields: &RequestFields,
        request: &Bound<'py, PyAny>,
        tokens: Option<&Bound<'py, PyList>>,
    ) -> PyResult<Self> {
        let py = request.py();
        let tokens = match tokens {
            Some(t) => Some(t.clone()),
            None => match request.getattr(pyo3::intern!(py, "all_token_ids")) {
                // any other sequence (vLLM's `ConstantList`) is copied now
                Ok(t) => match t.cast_into::<PyList>() {
                    Ok(list) => Some(list),
                    Err(e) => Some(
                        <PyList as pyo3::PyTypeInfo>::type_object(py)
                            .call1((e.into_inner(),))?
                            .cast_into::<PyList>()?,
                    ),
                },
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => None,
                Err(e) => return Err(e),
            },
        };
        let mut out = [None, None, None, None, None, None, None];
        for (slot, (field, _)) in out.iter_mut().zip(EVENT_FIELDS) {
            *slot = fields.get_opt(request, field)?;
        }
        namespace_type(py)?; // fetched now, not after the change
        Ok(EventInputs { tokens, fields: out })
    }

    /// The token ids of `[start, end)` and a `types.SimpleNamespace` of the fields read (a
    /// list field copied): what the `BlockStored` events over that span are built from. Runs
    /// no Python code.
    pub fn snapshot(&self, py: Python<'py>, start: usize, end: usize) -> PyResult<(Option<Py<PyList>>, Py<PyAny>)> {
        let kwargs = PyDict::new(py);
        for ((_, name), value) in EVENT_FIELDS.iter().zip(&self.fields) {
            let value = match value {
                Some(v) => match v.cast::<PyList>() {
                    Ok(l) => l.get_slice(0, l.len()).into_any(),
                    Err(_) => v.clone(),
                },
                None => py.None().into_bound(py),
            };
            kwargs.set_item(*name, value)?;
        }
        let tokens = self.tokens.as_ref().map(|t| t.get_slice(start.min(t.len()), end.min(t.len())).unbind());
        let ns = namespace_type(py)?.bind(py).call((), Some(&kwargs))?;
        Ok((tokens, ns.unbind()))
    }
}

/// `types.SimpleNamespace`.
fn namespace_type(py: Python<'_>) -> PyResult<&Py<PyAny>> {
    static NS: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    NS.get_or_try_init(py, || Ok::<_, PyErr>(py.import("types")?.getattr("SimpleNamespace")?.unbind()))
}
