//! What a `BlockStored` KV event reports about its request, taken when the blocks are cached.
//!
//! vLLM builds the event while it caches the blocks. kvblock buffers events in the Rust pool
//! and builds the Python objects when they are taken, so the request's token ids and the
//! fields its extra keys come from are read before the caching call (nothing can fail once it
//! has changed the pool) and copied right after it.

use super::convert::{extract_tokens, Tokens};
use super::fields::{Field, RequestFields};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// What a `BlockStored` event reports about its request, read before the caching call
/// changes anything: vLLM builds the event when it caches the blocks, so later changes to the
/// request must not show in it.
pub struct EventInputs<'py> {
    /// The request's token ids: its list, its integer buffer (vLLM 0.34's `TokenBuffer`, kept
    /// exported until the events are built right after the caching call: no Python code runs
    /// in between), or a copy of any other sequence.
    tokens: Option<EventTokens<'py>>,
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
    /// Read them from `request`; `tokens` is its token ids (`_all_token_ids`) when the caller
    /// has them (a list or an integer buffer is used as it is; else, or without them,
    /// `request.all_token_ids` is read: a list as it is, else `_all_token_ids` if it is an
    /// integer buffer, else a copy). Errors other than a missing attribute propagate.
    pub fn read(
        fields: &RequestFields,
        request: &Bound<'py, PyAny>,
        tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        let py = request.py();
        let given = match tokens {
            Some(t) => EventTokens::of(t)?,
            None => None,
        };
        let tokens = match given {
            Some(t) => Some(t),
            None => match request.getattr(Field::AllTokenIdsView.interned(py)) {
                Ok(t) => match t.cast_into::<PyList>() {
                    Ok(list) => Some(EventTokens::List(list)),
                    Err(e) => match fields.get_opt(request, Field::AllTokenIds)?.filter(|a| is_buffer(a)) {
                        // vLLM 0.34: `all_token_ids` is a ConstantList over this TokenBuffer
                        Some(buf) => EventTokens::of(&buf)?,
                        // any other sequence (vLLM's `ConstantList` over a list) is copied now
                        None => Some(EventTokens::List(
                            <PyList as pyo3::PyTypeInfo>::type_object(py)
                                .call1((e.into_inner(),))?
                                .cast_into::<PyList>()?,
                        )),
                    },
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
        let tokens = match &self.tokens {
            Some(t) => Some(t.slice(py, start, end)?.unbind()),
            None => None,
        };
        let ns = namespace_type(py)?.bind(py).call((), Some(&kwargs))?;
        Ok((tokens, ns.unbind()))
    }
}

/// A request's token ids as an event reads them.
enum EventTokens<'py> {
    List(Bound<'py, PyList>),
    /// An integer buffer, exported (borrowed in place when C-contiguous): no Python int per
    /// token until the event's own list is built.
    Buffer(Tokens),
}

/// True for an object with the buffer protocol other than `bytes`.
fn is_buffer(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: `obj` is a live object; PyObject_CheckBuffer only reads its type.
    let exports = unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0;
    exports && !obj.is_instance_of::<pyo3::types::PyBytes>()
}

impl<'py> EventTokens<'py> {
    /// A list as it is, an integer buffer read in place; None for anything else. A buffer
    /// that is not of integers (floats) is a `TypeError`, as when hashing it.
    fn of(obj: &Bound<'py, PyAny>) -> PyResult<Option<Self>> {
        if let Ok(list) = obj.cast::<PyList>() {
            return Ok(Some(EventTokens::List(list.clone())));
        }
        if !is_buffer(obj) {
            return Ok(None);
        }
        Ok(match extract_tokens(obj, "request._all_token_ids", 0)? {
            Tokens::Big(_) => None,
            t => Some(EventTokens::Buffer(t)),
        })
    }

    /// The ids of `[start, end)` (clipped to the length) as a new list of ints.
    fn slice(&self, py: Python<'py>, start: usize, end: usize) -> PyResult<Bound<'py, PyList>> {
        fn part<'py, T: Copy + IntoPyObject<'py>>(
            py: Python<'py>,
            s: &[T],
            a: usize,
            b: usize,
        ) -> PyResult<Bound<'py, PyList>> {
            let b = b.min(s.len());
            PyList::new(py, s[a.min(b)..b].iter().copied())
        }
        match self {
            EventTokens::List(t) => Ok(t.get_slice(start.min(t.len()), end.min(t.len()))),
            EventTokens::Buffer(Tokens::I32(b)) => part(py, b.as_slice(), start, end),
            EventTokens::Buffer(Tokens::I64(b)) => part(py, b.as_slice(), start, end),
            EventTokens::Buffer(Tokens::U32(b)) => part(py, b.as_slice(), start, end),
            EventTokens::Buffer(Tokens::U64(b)) => part(py, b.as_slice(), start, end),
            EventTokens::Buffer(Tokens::Big(_)) => Ok(PyList::empty(py)), // not built by `of`
        }
    }
}

/// `types.SimpleNamespace`.
fn namespace_type(py: Python<'_>) -> PyResult<&Py<PyAny>> {
    static NS: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    NS.get_or_try_init(py, || Ok::<_, PyErr>(py.import("types")?.getattr("SimpleNamespace")?.unbind()))
}
