//! The binding layer: the only module that names pyo3 or numpy.

pub mod args;
pub mod block_ids;
pub mod block_pool;
pub mod convert;
pub mod errors;
pub mod fields;
pub mod hashing;
pub mod manager;

use pyo3::prelude::*;

/// The compiled core of kvblock.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILD_PROFILE", if cfg!(debug_assertions) { "debug" } else { "release" })?;
    m.add("ALGORITHMS", pyo3::types::PyTuple::new(m.py(), crate::hashing::ALGORITHM_NAMES)?)?;
    m.add_class::<hashing::PyHashFunction>()?;
    m.add_class::<hashing::PyRequestBlockHasher>()?;
    m.add_class::<block_pool::PyBlockPool>()?;
    m.add_class::<block_ids::PyBlockIds>()?;
    m.add_class::<manager::PyManager>()?;
    m.add_function(wrap_pyfunction!(hashing::hash_block_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::hash_requests, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::hashing_threads, m)?)?;
    Ok(())
}
