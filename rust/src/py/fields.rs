//! Reads of request fields from Rust, and the one list of the request attributes Rust reads.
//!
//! The scheduler-facing manager calls read a handful of request attributes per call. For the
//! exact registered request type, a field that is an object `__slots__` member (as in
//! `kvblock.Request`) lives at a fixed offset known from its member descriptor, so it is read
//! directly; a plain instance attribute that nothing on the type overrides (as in vLLM's
//! `Request`) is read from the instance dict (see `fast/instance_dict.rs`). Anything else (a
//! subclass, a property, a type changed since) goes through ordinary `getattr`.

use super::fast::instance_dict::DictFields;
pub use super::fast::slots::SlotFactory;
use super::fast::slots::{object_slot_offset, read_object_slot, store_object_slot};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyType};

/// The request attributes the Rust core reads (or calls) on a request object, in [`NAMES`]'
/// order: the one list on the Rust side. Its Python side is `kvblock.request.RUST_READS`
/// (`tests/test_request_fields.py` fails when the two drift). Every read of a request
/// attribute in `rust/src/py/` names one of these.
#[derive(Clone, Copy)]
pub enum Field {
    RequestId,
    NumComputedTokens,
    AllTokenIds,
    BlockHashes,
    Status,
    NumInFlightTokens,
    SkipReadingPrefixCache,
    KvCacheReportMode,
    BlockHasher,
    LoraRequest,
    MmFeatures,
    CacheSalt,
    PromptEmbeds,
    HashLookahead,
    NextHashAt,
    PromptEmbedsBlockHashes,
    NumPromptTokens,
    SharedPrefixBoundary,
    SessionId,
    PromptIsTokenIds,
    PrefixCacheHitLimit,
    /// `num_tokens` (a property of both `Request`s).
    NumTokens,
    /// `_hash_block_size` (kvblock's `Request`: the block size its hashes are at).
    HashBlockSize,
    /// `retention` (kvblock's `Request`: retention ranges).
    Retention,
    /// `retention_priority` (kvblock's `Request`).
    RetentionPriority,
    /// `all_token_ids` (the property; [`Field::AllTokenIds`] is the list behind it).
    AllTokenIdsView,
    /// `update_block_hashes` (a method, called).
    UpdateBlockHashes,
    /// `is_finished` (a method, called: HiSparse's free keeps a finished request's host blocks).
    IsFinished,
}

impl Field {
    /// The attribute's name, interned once per process.
    pub fn interned(self, py: Python<'_>) -> &Bound<'_, PyString> {
        static CELL: pyo3::sync::PyOnceLock<[Py<PyString>; N]> = pyo3::sync::PyOnceLock::new();
        CELL.get_or_init(py, || NAMES.map(|n| PyString::intern(py, n).unbind()))[self as usize].bind(py)
    }
}

const N: usize = 28;

/// The names of [`Field`]'s attributes (exported as `kvblock._core.REQUEST_FIELDS`).
pub const NAMES: [&str; N] = [
    "request_id",
    "num_computed_tokens",
    "_all_token_ids",
    "block_hashes",
    "status",
    "num_in_flight_tokens",
    "skip_reading_prefix_cache",
    "kv_cache_report_mode",
    "_block_hasher",
    "lora_request",
    "mm_features",
    "cache_salt",
    "prompt_embeds",
    "_hash_lookahead",
    "_next_hash_at",
    "_prompt_embeds_per_block_hashes",
    "num_prompt_tokens",
    "shared_prefix_boundary",
    "session_id",
    "prompt_is_token_ids",
    "prefix_cache_hit_limit",
    "num_tokens",
    "_hash_block_size",
    "retention",
    "retention_priority",
    "all_token_ids",
    "update_block_hashes",
    "is_finished",
];

/// Slot offsets of `kvblock.Request` and the interned field names.
pub struct RequestFields {
    ty: Option<Py<PyType>>,
    offsets: [isize; N],
    names: [Py<PyString>; N],
    /// The fields read from the instance dict of the registered type.
    dict: DictFields,
    /// A missing attribute stays the `AttributeError` reading it raised (vLLM's managers read
    /// request attributes plainly); otherwise it is a `TypeError` naming the field.
    missing_is_attribute_error: bool,
}

impl RequestFields {
    /// Field names only: every read goes through `getattr`.
    pub fn generic(py: Python<'_>) -> Self {
        RequestFields {
            ty: None,
            offsets: [-1; N],
            names: NAMES.map(|n| PyString::intern(py, n).unbind()),
            dict: DictFields::none(),
            missing_is_attribute_error: false,
        }
    }

    /// These fields with a missing attribute raised as the `AttributeError` itself, with the
    /// field named (what vLLM's manager raises for an object lacking a request attribute).
    pub fn with_attribute_errors(mut self) -> Self {
        self.missing_is_attribute_error = true;
        self
    }

    /// Start loading the name object of `field` (its hash and type are read by a dict lookup).
    #[inline(always)]
    pub fn prefetch_name(&self, field: Field) {
        crate::prefetch::prefetch_line(self.names[field as usize].as_ptr().cast());
    }

    /// True if `request`'s type is exactly the registered request type.
    #[inline(always)]
    pub fn is_exact_type(&self, request: &Bound<'_, PyAny>) -> bool {
        // the type pointers compared (no new reference to the type taken)
        self.ty.as_ref().is_some_and(|ty| request.get_type_ptr() == ty.as_ptr().cast::<ffi::PyTypeObject>())
    }

    /// Learn the slot offsets of `request_type` and which of its other fields are plain
    /// instance attributes (the rest keep using `getattr`).
    pub fn for_type(request_type: &Bound<'_, PyType>) -> PyResult<Self> {
        let py = request_type.py();
        let mut f = Self::generic(py);
        for (i, name) in NAMES.iter().enumerate() {
            if let Some(offset) = object_slot_offset(request_type, name)? {
                f.offsets[i] = offset;
            }
        }
        f.dict = DictFields::for_type(request_type, &NAMES, |i| f.offsets[i] < 0)?;
        f.ty = Some(request_type.clone().unbind());
        Ok(f)
    }

    /// The fields of `kvblock.request.Request`, learnt once per process.
    pub fn of_kvblock_request(py: Python<'_>) -> PyResult<&'static RequestFields> {
        static CELL: pyo3::sync::PyOnceLock<RequestFields> = pyo3::sync::PyOnceLock::new();
        CELL.get_or_try_init(py, || {
            let ty = py.import("kvblock.request")?.getattr("Request")?;
            let ty = ty.cast_into::<PyType>().map_err(|e| pyo3::exceptions::PyTypeError::new_err(e.to_string()))?;
            RequestFields::for_type(&ty)
        })
    }

    /// `getattr(request, field)`, read straight from the slot for the exact request type.
    #[inline]
    pub fn get<'py>(&self, request: &Bound<'py, PyAny>, field: Field) -> PyResult<Bound<'py, PyAny>> {
        match self.get_fast(request, field) {
            Some(v) => Ok(v),
            None => self.get_slow(request, field as usize),
        }
    }

    /// The field, or None when the request has no such attribute (an optional field); any
    /// other error raised while reading it passes through.
    #[inline]
    pub fn get_opt<'py>(&self, request: &Bound<'py, PyAny>, field: Field) -> PyResult<Option<Bound<'py, PyAny>>> {
        if let Some(v) = self.get_fast(request, field) {
            return Ok(Some(v));
        }
        self.dict.relearn(request);
        match request.getattr(self.names[field as usize].bind(request.py())) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(request.py()) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The field read from its object slot or instance dict (a request of exactly the
    /// registered type whose slot is set, or whose dict holds the field), else None.
    #[inline(always)]
    fn get_fast<'py>(&self, request: &Bound<'py, PyAny>, field: Field) -> Option<Bound<'py, PyAny>> {
        // SAFETY: the pointer is owned by the request's slot or dict, and taken as a new
        // reference before any Python code can run.
        self.get_borrowed(request, field).map(|p| unsafe { Bound::from_borrowed_ptr(request.py(), p) })
    }

    /// The object [`RequestFields::get`] would return, as a borrowed pointer, when it is read
    /// straight from a slot or the instance dict (else None: the caller uses `get`). No new
    /// reference is taken, so the object itself is not touched: for an identity check, valid
    /// only until Python code runs.
    #[inline(always)]
    pub fn get_borrowed(&self, request: &Bound<'_, PyAny>, field: Field) -> Option<*mut ffi::PyObject> {
        let i = field as usize;
        if !self.is_exact_type(request) {
            return None;
        }
        let off = self.offsets[i];
        if off >= 0 {
            // SAFETY: the object's type is exactly the type whose slot offsets we read
            // (offsets are only learnt with the fast paths on).
            let p = unsafe { read_object_slot(request.as_ptr(), off) };
            return (!p.is_null()).then_some(p);
        }
        self.dict.get_borrowed(request, i, self.names[i].bind(request.py()))
    }

    /// The names of the fields read from `request`'s `__dict__` now, without `getattr`.
    pub fn dict_read_fields(&self, request: &Bound<'_, PyAny>) -> Vec<&'static str> {
        let mask = self.dict.active(request);
        NAMES.iter().enumerate().filter(|&(i, _)| mask & (1 << i) != 0).map(|(_, n)| *n).collect()
    }

    /// `getattr` for a field that is not a set slot of the exact request type.
    #[cold]
    #[inline(never)]
    fn get_slow<'py>(&self, request: &Bound<'py, PyAny>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        self.dict.relearn(request);
        request
            .getattr(self.names[i].bind(request.py()))
            .map_err(|e| not_a_request(request, NAMES[i], e, self.missing_is_attribute_error))
    }

    /// `setattr(request, field, value)`, stored straight into the slot for the exact request
    /// type (as the slot's member descriptor would: the old value is released).
    pub fn set(&self, request: &Bound<'_, PyAny>, field: Field, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let i = field as usize;
        let off = self.offsets[i];
        if let (true, Some(ty)) = (off >= 0, &self.ty) {
            if request.get_type().is(ty.bind(request.py())) {
                // SAFETY: the object's type is exactly the type whose slot offsets we read.
                unsafe { store_object_slot(request.as_ptr(), off, value) };
                return Ok(());
            }
        }
        request.setattr(self.names[i].bind(request.py()), value)
    }

    /// True if `request` has anything that adds extra keys to its block hashes: a LoRA
    /// adapter, multimodal items, a cache salt or prompt embeddings (vLLM's test in
    /// `generate_block_hash_extra_keys`).
    pub fn has_extra_keys(&self, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.get(request, Field::LoraRequest)?.is_truthy()?
            || self.get(request, Field::MmFeatures)?.is_truthy()?
            || self.get(request, Field::CacheSalt)?.is_truthy()?
            || !self.get(request, Field::PromptEmbeds)?.is_none())
    }
}

/// A missing request attribute as a `TypeError` (or, `as_attribute_error`, an
/// `AttributeError`) naming the field and the object's type (`None` or some other object
/// passed where a request belongs); other errors pass through.
#[cold]
fn not_a_request(request: &Bound<'_, PyAny>, name: &str, e: PyErr, as_attribute_error: bool) -> PyErr {
    let py = request.py();
    if !e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) {
        return e;
    }
    let ty = request.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    let msg = format!("request: expected a request with a `{name}` attribute, got {ty}");
    if as_attribute_error {
        pyo3::exceptions::PyAttributeError::new_err(msg)
    } else {
        pyo3::exceptions::PyTypeError::new_err(msg)
    }
}
