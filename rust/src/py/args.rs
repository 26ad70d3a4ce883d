//! Integer arguments of the Python API, used with `#[pyo3(from_py_with = args::name)]`.
//!
//! PyO3's own conversion raises `OverflowError` for an int that does not fit the parameter
//! (with a message that names neither the argument nor the value) and accepts `True` as 1.
//! These extractors make a bool or a non-int a `TypeError` and an int out of range a
//! `ValueError` (one that does not fit in 64 bits: `IntOutOfRangeError`, also an
//! `OverflowError`), each naming the argument (and the value).

use super::errors::{type_err, value_err};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyString};

/// The value of an `int` argument (or an object with `__index__`, e.g. a numpy integer) that
/// fits in i64.
pub fn int64(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<i64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(type_err(arg, "expected int, got bool"));
    }
    if let Ok(v) = obj.extract::<i64>() {
        return Ok(v);
    }
    let is_int = obj.is_instance_of::<PyInt>() || obj.hasattr(pyo3::intern!(obj.py(), "__index__")).unwrap_or(false);
    if is_int {
        let msg = format!("{arg}: {obj} is out of range (must fit in a signed 64-bit integer)");
        return Err(super::errors::int_out_of_range(obj.py(), msg));
    }
    let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    Err(type_err(arg, format!("expected int, got {ty}")))
}

/// A bool passed where vLLM's code takes a count, as the int it is in Python arithmetic
/// (`True` is 1, `False` 0); None for any other object. kvblock's own API refuses a bool count
/// ([`int64`]); its vLLM manager takes one as vLLM does.
pub fn bool_count(obj: &Bound<'_, PyAny>) -> Option<usize> {
    obj.cast::<PyBool>().ok().map(|b| usize::from(b.is_true()))
}

/// A count as vLLM's code uses it: a bool is 0 or 1 ([`bool_count`]), else [`count`].
pub fn vllm_count(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<usize> {
    match bool_count(obj) {
        Some(n) => Ok(n),
        None => count(obj, arg),
    }
}

/// [`int64`] narrowed to `[0, 2**32)`.
pub fn uint32(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<u32> {
    let v = int64(obj, arg)?;
    u32::try_from(v).map_err(|_| value_err(arg, format!("{v} is out of range (must be in [0, 2**32))")))
}

/// [`int64`] narrowed to `[0, usize::MAX]`: a negative value is a `ValueError`.
pub fn count(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<usize> {
    let v = int64(obj, arg)?;
    usize::try_from(v).map_err(|_| value_err(arg, format!("must be >= 0, got {v}")))
}

/// [`int64`] narrowed to `[0, usize::MAX]`, or None for `None`.
pub fn opt_count(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Option<usize>> {
    if obj.is_none() {
        return Ok(None);
    }
    let v = int64(obj, arg)?;
    usize::try_from(v).map(Some).map_err(|_| value_err(arg, format!("must be >= 0, got {v}")))
}

/// [`int64`] that must be > 0, or None for `None`: 0 and a negative value alike are a
/// `ValueError` saying "must be > 0".
pub fn opt_positive(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Option<usize>> {
    if obj.is_none() {
        return Ok(None);
    }
    let v = int64(obj, arg)?;
    match usize::try_from(v) {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(value_err(arg, format!("must be > 0, got {v}"))),
    }
}

/// A sequence of ids (KV-cache group ids), each a [`uint32`] named `arg[i]` (a bool, a
/// non-int or an int outside `[0, 2**32)` is refused, naming the item); a str, bytes or an
/// object that is not iterable is a `TypeError` naming `arg`. PyO3's own `Vec<u32>`
/// conversion raised an `OverflowError` naming nothing for `[-1]`.
pub fn uint32_seq(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<u32>> {
    let mut out = Vec::new();
    for (i, item) in seq_items(obj, arg, "ints")?.enumerate() {
        let item = item?;
        // the common case without building the item's name; a bool (an int to PyO3) and
        // anything that does not fit are read again by `uint32`, which names the item
        match item.extract::<u32>() {
            Ok(v) if !item.is_instance_of::<PyBool>() => out.push(v),
            _ => out.push(uint32(&item, &format!("{arg}[{i}]"))?),
        }
    }
    Ok(out)
}

/// The items of a sequence argument; a str, bytes or an object that is not iterable is a
/// `TypeError` naming `arg` (`what`: the items expected).
fn seq_items<'py>(obj: &Bound<'py, PyAny>, arg: &str, what: &str) -> PyResult<Bound<'py, pyo3::types::PyIterator>> {
    let not_a_sequence = || {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
        type_err(arg, format!("expected a sequence of {what}, got {ty}"))
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(not_a_sequence());
    }
    obj.try_iter().map_err(|_| not_a_sequence())
}

/// A sequence argument's items, each read by `item` under the name `arg[i]`; a str, bytes or
/// an object that is not iterable is a `TypeError` naming `arg` (`what`: the items expected).
pub fn seq_of<T>(
    obj: &Bound<'_, PyAny>,
    arg: &str,
    what: &str,
    item: impl Fn(&Bound<'_, PyAny>, &str) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    let mut out = Vec::new();
    for (i, x) in seq_items(obj, arg, what)?.enumerate() {
        out.push(item(&x?, &format!("{arg}[{i}]"))?);
    }
    Ok(out)
}

/// A sequence of [`count`]s, each named `arg[i]`.
pub fn count_seq(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<usize>> {
    seq_of(obj, arg, "ints", count)
}

/// A sequence of [`uint64`]s, each named `arg[i]`.
pub fn uint64_seq(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<u64>> {
    seq_of(obj, arg, "ints", uint64)
}

/// [`uint32_seq`], or None for `None`.
pub fn opt_uint32_seq(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Option<Vec<u32>>> {
    if obj.is_none() {
        return Ok(None);
    }
    uint32_seq(obj, arg).map(Some)
}

/// The `n` items of a tuple (or other sequence of length `n`, not a str) named `arg`; anything
/// else is a `TypeError` naming `arg`.
pub fn tuple_items<'py>(obj: &Bound<'py, PyAny>, arg: &str, n: usize) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let bad = || {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
        type_err(arg, format!("expected a tuple of {n} items, got {ty}"))
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(bad());
    }
    let items: Vec<Bound<'py, PyAny>> = obj.try_iter().map_err(|_| bad())?.collect::<PyResult<_>>()?;
    if items.len() != n {
        return Err(type_err(arg, format!("expected a tuple of {n} items, got {}", items.len())));
    }
    Ok(items)
}

/// A sequence of `(count, count)` pairs, the items named `arg[i][j]`.
pub fn count_pairs(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<(usize, usize)>> {
    seq_of(obj, arg, "(int, int) tuples", |x, name| {
        let t = tuple_items(x, name, 2)?;
        Ok((count(&t[0], &format!("{name}[0]"))?, count(&t[1], &format!("{name}[1]"))?))
    })
}

/// A sequence of `(uint64, count)` pairs, the items named `arg[i][j]`.
pub fn uint64_count_pairs(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<(u64, usize)>> {
    seq_of(obj, arg, "(int, int) tuples", |x, name| {
        let t = tuple_items(x, name, 2)?;
        Ok((uint64(&t[0], &format!("{name}[0]"))?, count(&t[1], &format!("{name}[1]"))?))
    })
}

/// A str item named `arg` (a `TypeError` naming it otherwise).
pub fn string(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<String> {
    match obj.cast::<PyString>() {
        Ok(s) => utf8(s, arg).map(str::to_owned),
        Err(_) => {
            let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
            Err(type_err(arg, format!("expected str, got {ty}")))
        }
    }
}

/// A sequence of `(str, count)` pairs, the items named `arg[i][j]`.
pub fn str_count_pairs(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<(String, usize)>> {
    seq_of(obj, arg, "(str, int) tuples", |x, name| {
        let t = tuple_items(x, name, 2)?;
        Ok((string(&t[0], &format!("{name}[0]"))?, count(&t[1], &format!("{name}[1]"))?))
    })
}

/// A sequence of `(str, count, count)` triples, the items named `arg[i][j]`.
pub fn str_count_triples(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<(String, usize, usize)>> {
    seq_of(obj, arg, "(str, int, int) tuples", |x, name| {
        let t = tuple_items(x, name, 3)?;
        Ok((
            string(&t[0], &format!("{name}[0]"))?,
            count(&t[1], &format!("{name}[1]"))?,
            count(&t[2], &format!("{name}[2]"))?,
        ))
    })
}

/// [`int64`], or None for `None`.
pub fn opt_int64(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Option<i64>> {
    if obj.is_none() {
        return Ok(None);
    }
    int64(obj, arg).map(Some)
}

macro_rules! named {
    ($kind:ident -> $t:ty: $($f:ident = $name:literal),* $(,)?) => {
        $(
            #[doc = concat!("The `", $name, "` argument (see [`", stringify!($kind), "`]).")]
            pub fn $f(obj: &Bound<'_, PyAny>) -> PyResult<$t> {
                $kind(obj, $name)
            }
        )*
    };
}

named!(int64 -> i64:
    n = "n", block_id = "block_id", block_size = "block_size", start = "start",
    num_gpu_blocks = "num_gpu_blocks", hash_block_size = "hash_block_size",
    num_new_tokens = "num_new_tokens", num_new_computed_tokens = "num_new_computed_tokens",
    num_lookahead_tokens = "num_lookahead_tokens", num_external_computed_tokens = "num_external_computed_tokens",
    num_encoder_tokens = "num_encoder_tokens", reserved_blocks = "reserved_blocks",
    num_computed_tokens = "num_computed_tokens",
    num_hash_lookahead_tokens = "num_hash_lookahead_tokens",
    digest_memo_blocks = "digest_memo_blocks",
);
named!(uint32 -> u32:
    block_id_u32 = "block_id", group_id = "group_id", src = "src", dst = "dst",
);
named!(uint32 -> u32: instance_id = "id");
named!(uint32_seq -> Vec<u32>: kv_cache_group_ids = "kv_cache_group_ids");
named!(opt_uint32_seq -> Option<Vec<u32>>: opt_ids = "ids");
named!(count -> usize:
    num_cached_blocks = "num_cached_blocks", num_full_blocks = "num_full_blocks",
    block_size_count = "block_size", warm_from = "warm_from", threads = "threads",
    host_group = "host_group", num_blocks_count = "num_blocks", max_model_len = "max_model_len",
    num_reprefillable_tokens = "num_reprefillable_tokens", group = "group",
    num_computed_tokens_count = "num_computed_tokens", num_host_pages = "num_host_pages",
    k = "k", start_count = "start", num_tokens = "num_tokens", num_pages = "num_pages",
    num_held_pages = "num_held_pages",
);
named!(count_seq -> Vec<usize>: resident_groups = "resident_groups", admission_caps = "admission_caps");
named!(count_pairs -> Vec<(usize, usize)>: hot_groups = "hot_groups");
named!(uint64_count_pairs -> Vec<(u64, usize)>: enqueued = "enqueued", completed = "completed");
named!(str_count_pairs -> Vec<(String, usize)>: requests_pairs = "requests");
named!(str_count_triples -> Vec<(String, usize, usize)>: requests_triples = "requests");
named!(opt_count -> Option<usize>: max_blocks = "max_blocks");
named!(opt_positive -> Option<usize>: opt_block_size = "block_size");
named!(uint64 -> u64: now_ms = "now_ms", ttl_ms = "ttl_ms", watcher = "watcher",
    birth_time_ns = "birth_time_ns", last_access_ns = "last_access_ns", block_size_u64 = "block_size",
    trace_block_size = "trace_block_size", num_blocks_u64 = "num_blocks",
);
named!(uint64_seq -> Vec<u64>: history = "history", capacities = "capacities");
named!(opt_str -> Option<String>: medium = "medium");

/// [`int64`] narrowed to `[0, 2**63)`: a negative value is a `ValueError` naming the argument
/// (PyO3's own `u64` conversion says "can't convert negative int to unsigned").
pub fn uint64(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<u64> {
    let v = int64(obj, arg)?;
    u64::try_from(v).map_err(|_| value_err(arg, format!("must be >= 0, got {v}")))
}

/// An int in `[0, 2**64)` (a random seed: `random.getrandbits(64)`); a bool or a non-int is a
/// `TypeError`, any other int a `ValueError`, each naming the argument.
pub fn uint64_full(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<u64> {
    if !obj.is_instance_of::<PyBool>() {
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(v);
        }
    }
    let v = int64(obj, arg)?; // the TypeError, or the negative value
    Err(value_err(arg, format!("{v} is out of range (must be in [0, 2**64))")))
}
named!(uint64_full -> u64: seed = "seed");

/// A `str` or `None` argument; anything else is a `TypeError` naming it.
pub fn opt_str(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Option<String>> {
    if obj.is_none() {
        return Ok(None);
    }
    match obj.cast::<PyString>() {
        Ok(s) => utf8(s, arg).map(|s| Some(s.to_owned())),
        Err(_) => {
            let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
            Err(type_err(arg, format!("expected str or None, got {ty}")))
        }
    }
}
named!(opt_int64 -> Option<i64>: end = "end");

/// A str argument as UTF-8: a lone surrogate (which UTF-8 cannot encode) is a `ValueError`
/// naming the argument, not an anonymous `UnicodeEncodeError`.
pub fn utf8<'a>(s: &'a Bound<'_, PyString>, arg: &str) -> PyResult<&'a str> {
    s.to_str().map_err(|_| {
        value_err(
            arg,
            format!(
                "{} cannot be encoded as UTF-8 (a lone surrogate)",
                s.repr().map(|r| r.to_string()).unwrap_or_default()
            ),
        )
    })
}
