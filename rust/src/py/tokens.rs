//! The check of token ids a request stores (`kvblock.Request`'s prompt and appended outputs).
//!
//! Token ids are hashed only once their block completes, so a bad one kept in a request's
//! token list would be found blocks later, when the request could no longer grow. They are
//! checked where they enter instead: an `int` of any size (not a `bool`), or an integer-like
//! with `__index__` such as a numpy integer (hashed as the int it holds).

use super::convert::int_of;
use super::errors::type_err;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// `check_token_ids(token_ids, arg)`: raise `TypeError` naming `arg[i]` at the first item of
/// the list `token_ids` that is not a token id; nothing is changed.
#[pyfunction]
#[pyo3(signature = (token_ids, arg="token_ids"))]
pub fn check_token_ids(token_ids: &Bound<'_, PyList>, arg: &str) -> PyResult<()> {
    for (i, item) in token_ids.iter().enumerate() {
        // SAFETY: `item` is a live object; PyLong_CheckExact only reads its type.
        if unsafe { ffi::PyLong_CheckExact(item.as_ptr()) } != 0 {
            continue;
        }
        if int_of(&item)?.is_none() {
            let ty = item.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
            return Err(type_err(&format!("{arg}[{i}]"), format!("a token id must be int, got {ty}")));
        }
    }
    Ok(())
}
