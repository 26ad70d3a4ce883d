//! Mapping of core errors to Python exceptions, and the panic guard of the boundary.

use crate::error::Error;
use pyo3::exceptions::{
    PyIndexError, PyKeyError, PyMemoryError, PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::PyErr;

// `kvblock`: the class's `__module__`, where it is exported (pickle finds it there, and
// tracebacks print `kvblock.StaleHitError`)
pyo3::create_exception!(
    kvblock,
    StaleHitError,
    PyValueError,
    "Hit blocks passed to allocate_slots were evicted and handed out again after get_computed_blocks \
     returned them (kvblock's own API): nothing changed; look the request up again."
);

/// `IntOutOfRangeError(ValueError, OverflowError)`: an int argument that does not fit in 64
/// bits. It is a `ValueError` (kvblock's API reports a bad value so) and an `OverflowError`,
/// which Python raises where such an int is used as a size or an index (`[b] * 2**70`,
/// `islice(x, 2**70)`), as vLLM's code does with it: a caller catching either sees it.
/// A class of two built-in bases, made once by `type(...)` (PyO3's exception macro takes one).
pub fn int_out_of_range_type(py: pyo3::Python<'_>) -> pyo3::PyResult<&pyo3::Bound<'_, pyo3::types::PyType>> {
    use pyo3::prelude::*;
    static TYPE: pyo3::sync::PyOnceLock<pyo3::Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();
    TYPE.get_or_try_init(py, || {
        let bases = (py.get_type::<PyValueError>(), py.get_type::<pyo3::exceptions::PyOverflowError>());
        let ns = pyo3::types::PyDict::new(py);
        ns.set_item("__module__", "kvblock")?;
        ns.set_item(
            "__doc__",
            "An int argument that does not fit in 64 bits: a ValueError (kvblock's API) and an \
             OverflowError (what Python raises where such an int is used as a size or index, as \
             vLLM's code does).",
        )?;
        let ty = py.get_type::<pyo3::types::PyType>().call1(("IntOutOfRangeError", bases, ns))?;
        Ok(ty.cast_into::<pyo3::types::PyType>()?.unbind())
    })
    .map(|t| t.bind(py))
}

/// An [`int_out_of_range_type`] error with `msg`.
pub fn int_out_of_range(py: pyo3::Python<'_>, msg: String) -> PyErr {
    match int_out_of_range_type(py) {
        Ok(ty) => PyErr::from_type(ty.clone(), msg),
        Err(e) => e,
    }
}

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
