//! The binding layer: the only module that names pyo3 or numpy.

pub mod args;
pub mod block_ids;
pub mod block_pool;
#[cfg(feature = "bench-timers")]
pub mod call_timer;
pub mod capacity;
pub mod convert;
pub mod errors;
pub mod events;
pub mod fast;
pub mod fields;
pub mod gil_cell;
pub mod hashes;
pub mod hashing;
pub mod hisparse;
pub mod hit_verify;
pub mod index;
pub mod manager;
pub mod raw_events;
pub mod request_hasher;
pub mod retention;
pub mod tokens;

use pyo3::prelude::*;

/// The compiled core of kvblock.
///
/// It needs the GIL (`gil_cell.rs`): a free-threaded interpreter turns its GIL back on when
/// it imports a module that declares so, and the import fails where the GIL was forced off.
#[pymodule(gil_used = true)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    if let Ok(is_gil_enabled) = m.py().import("sys")?.getattr("_is_gil_enabled") {
        if !is_gil_enabled.call0()?.is_truthy()? {
            return Err(pyo3::exceptions::PyImportError::new_err(
                "kvblock._core needs the GIL; run without PYTHON_GIL=0 / -X gil=0",
            ));
        }
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // the CPython fast paths (fast/mod.rs): the switch is read here, once
    m.add("FAST_PATHS", fast::enabled())?;
    m.add("BUILD_PROFILE", if cfg!(debug_assertions) { "debug" } else { "release" })?;
    m.add("REQUEST_FIELDS", pyo3::types::PyTuple::new(m.py(), fields::NAMES)?)?;
    m.add("ALGORITHMS", pyo3::types::PyTuple::new(m.py(), crate::hashing::ALGORITHM_NAMES)?)?;
    m.add_class::<hashing::PyHashFunction>()?;
    m.add_class::<request_hasher::PyRequestBlockHasher>()?;
    m.add_class::<block_pool::PyBlockPool>()?;
    m.add_class::<block_ids::PyBlockIds>()?;
    m.add_class::<raw_events::RawBlockStored>()?;
    m.add_class::<raw_events::RawBlockRemoved>()?;
    m.add_class::<raw_events::RawAllBlocksCleared>()?;
    m.add_class::<manager::PyManager>()?;
    m.add_class::<hisparse::PyResidency>()?;
    m.add_class::<capacity::PyCapacityRequests>()?;
    m.add_class::<capacity::PyLruCurve>()?;
    m.add_function(wrap_pyfunction!(capacity::capacity_trie_ids, m)?)?;
    m.add("StaleHitError", m.py().get_type::<errors::StaleHitError>())?;
    m.add("IntOutOfRangeError", errors::int_out_of_range_type(m.py())?)?;
    m.add_class::<index::PyPrefixIndex>()?;
    m.add_function(wrap_pyfunction!(fast::entry::_fast_entry, m)?)?;
    m.add_function(wrap_pyfunction!(fast::block_ids_method::_fast_get_block_ids, m)?)?;
    // the benches' call timers, only in a build with the bench-timers cargo feature
    m.add("BENCH_TIMERS", cfg!(feature = "bench-timers"))?;
    #[cfg(feature = "bench-timers")]
    {
        m.add_class::<call_timer::PyCallClock>()?;
        m.add_class::<call_timer::PyTimedCall>()?;
    }
    m.add_function(wrap_pyfunction!(index::parent_tag, m)?)?;
    m.add_function(wrap_pyfunction!(index::event_ints, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::hash_block_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(request_hasher::hash_requests, m)?)?;
    m.add_function(wrap_pyfunction!(request_hasher::hashing_threads, m)?)?;
    m.add_function(wrap_pyfunction!(tokens::check_token_ids, m)?)?;
    m.add_function(wrap_pyfunction!(retention::check_retention, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::token_encoder, m)?)?;
    Ok(())
}
