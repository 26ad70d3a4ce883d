//! Mapping of core errors to Python exceptions, and the panic guard of the boundary.

use crate::error::Error;
use pyo3::exceptions::{
    PyIndexError, PyKeyError, PyMemoryError, PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::PyErr;

pyo3::create_exception!(
    _core,
    StaleHitError,
    PyValueError,
    "Hit blocks passed to allocate_slots were evicted and handed out again after get_computed_blocks \
     returned them (kvblock's own API): nothing changed; look the request up again."
);

/// Convert a core error into the Python exception vLLM callers expect.
pub fn to_py(e: Error) -> PyErr {
    match e {
        Error::Type(m) => PyTypeError::new_err(m),
        Error::NotFound(m) => PyKeyError::new_err(m),
        Error::State(m) => PyRuntimeError::new_err(m),
        Error::Memory(m) => PyMemoryError::new_err(m),
        Error::Index(m) => PyIndexError::new_err(m),
        Error::NotImplemented(m) => PyNotImplementedError::new_err(m),
        Error::Assertion(m) => pyo3::exceptions::PyAssertionError::new_err(m),
        Error::StaleHit(m) => StaleHitError::new_err(m),
        e @ (Error::Value(_) | Error::NotEnoughFreeBlocks { .. } | Error::NoFreeBlocks) => {
            PyValueError::new_err(e.to_string())
        }
    }
}

/// Extension to turn a core `Result` into a `PyResult`.
pub trait IntoPy<T> {
    /// Map the error with [`to_py`].
    fn py_err(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPy<T> for crate::error::Result<T> {
    #[inline(always)]
    fn py_err(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}

/// A `ValueError` naming the argument.
pub fn value_err(arg: &str, msg: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{arg}: {msg}"))
}

/// A `TypeError` naming the argument.
pub fn type_err(arg: &str, msg: impl std::fmt::Display) -> PyErr {
    PyTypeError::new_err(format!("{arg}: {msg}"))
}
