//! Extraction of Python inputs: token-id sequences (lists, tuples, buffers such as numpy
//! arrays and `array.array`, any other sequence) and hashable values.

use super::errors::{type_err, value_err};
use super::fast::ints::exact_int_i64;
pub use super::fast::ints::list_i64;
use crate::hashing::value::{Int, ObjId, Value};
use pyo3::buffer::{ElementType, PyBuffer, PyUntypedBuffer};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};

/// Token ids as received: borrowed from a contiguous buffer, or converted.
pub enum Tokens {
    I32(TokenBuf<i32>),
    I64(TokenBuf<i64>),
    U32(TokenBuf<u32>),
    U64(TokenBuf<u64>),
    /// A sequence holding ints beyond 64 bits.
    Big(Vec<Int>),
}

/// A typed, 1-D token buffer: zero-copy over a C-contiguous Python buffer, else a copy.
pub enum TokenBuf<T> {
    Borrowed(PyBuffer<T>),
    Owned(Vec<T>),
}

impl<T: pyo3::buffer::Element + Copy> TokenBuf<T> {
    /// The token ids. For a borrowed buffer the exporter must not be mutated meanwhile (the
    /// buffer export keeps it alive and unresizable).
    #[inline]
    pub fn as_slice(&self) -> &[T] {
        match self {
            TokenBuf::Owned(v) => v,
            TokenBuf::Borrowed(b) => {
                let n = b.item_count();
                if n == 0 {
                    return &[];
                }
                // SAFETY: the buffer is 1-D, C-contiguous, of element type T (checked in
                // `extract_tokens`) and stays exported (hence alive) as long as `self`.
                unsafe { std::slice::from_raw_parts(b.buf_ptr() as *const T, n) }
            }
        }
    }
}

impl Tokens {
    /// 32-bit ids widened to `i64` where the CPU has the SIMD token encoder (it reads `i64`
    /// slices; 32-bit ones take the scalar path): a copy of 8 bytes a token, cheaper than
    /// encoding them one by one. Anything else is returned as it is.
    pub fn widened_for_simd(self) -> Tokens {
        if !crate::hashing::token_simd::available() {
            return self;
        }
        match self {
            Tokens::I32(b) => Tokens::I64(TokenBuf::Owned(b.as_slice().iter().map(|&t| i64::from(t)).collect())),
            Tokens::U32(b) => Tokens::I64(TokenBuf::Owned(b.as_slice().iter().map(|&t| i64::from(t)).collect())),
            t => t,
        }
    }

    /// Number of token ids.
    pub fn len(&self) -> usize {
        match self {
            Tokens::I32(b) => b.as_slice().len(),
            Tokens::I64(b) => b.as_slice().len(),
            Tokens::U32(b) => b.as_slice().len(),
            Tokens::U64(b) => b.as_slice().len(),
            Tokens::Big(v) => v.len(),
        }
    }
}

/// Apply a generic function to the typed token slice of a `Tokens`.
#[macro_export]
macro_rules! with_token_slice {
    ($tokens:expr, |$s:ident| $body:expr) => {
        match $tokens {
            $crate::py::convert::Tokens::I32(b) => {
                let $s = b.as_slice();
                $body
            }
            $crate::py::convert::Tokens::I64(b) => {
                let $s = b.as_slice();
                $body
            }
            $crate::py::convert::Tokens::U32(b) => {
                let $s = b.as_slice();
                $body
            }
            $crate::py::convert::Tokens::U64(b) => {
                let $s = b.as_slice();
                $body
            }
            $crate::py::convert::Tokens::Big(v) => {
                let $s: Vec<&$crate::hashing::value::Int> = v.iter().collect();
                let $s = &$s[..];
                $body
            }
        }
    };
}

fn typed<T: pyo3::buffer::Element + Copy>(py: Python<'_>, raw: PyUntypedBuffer, arg: &str) -> PyResult<TokenBuf<T>> {
    // An empty buffer may have a null or unaligned pointer; a C-contiguous one whose items
    // are not aligned (e.g. a numpy view at an odd byte offset) is copied item by item.
    if raw.item_count() == 0 {
        return Ok(TokenBuf::Owned(Vec::new()));
    }
    if raw.is_c_contiguous() && !(raw.buf_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        let n = raw.item_count();
        let p = raw.buf_ptr() as *const T;
        // SAFETY: a 1-D C-contiguous buffer of `n` items of T's size (the format was matched
        // to T by the caller), exported (alive) for the duration; read without alignment.
        let v = (0..n).map(|i| unsafe { p.add(i).read_unaligned() }).collect();
        return Ok(TokenBuf::Owned(v));
    }
    let buf: PyBuffer<T> = raw.into_typed::<T>().map_err(|e| type_err(arg, e))?;
    if buf.is_c_contiguous() {
        Ok(TokenBuf::Borrowed(buf))
    } else {
        Ok(TokenBuf::Owned(buf.to_vec(py)?))
    }
}

/// What the values of argument `arg` are called in messages, plain and as integers: token
/// ids, or (block ids, counts) integers.
fn nouns(arg: &str) -> (&'static str, &'static str) {
    if arg.ends_with("token_ids") {
        ("token ids", "integer token ids")
    } else {
        ("integers", "integers")
    }
}

/// What a sequence argument `arg` holds, in messages: "int token ids", or "ints" (block ids,
/// counts).
fn sequence_noun(arg: &str) -> &'static str {
    if arg.ends_with("token_ids") {
        "int token ids"
    } else {
        "ints"
    }
}

/// A buffer of small integers `T`, widened to `U`.
fn widened<T: pyo3::buffer::Element + Copy, U: From<T>>(
    py: Python<'_>,
    raw: PyUntypedBuffer,
    arg: &str,
) -> PyResult<TokenBuf<U>> {
    Ok(TokenBuf::Owned(typed::<T>(py, raw, arg)?.as_slice().iter().map(|&x| U::from(x)).collect()))
}

fn from_buffer(py: Python<'_>, raw: PyUntypedBuffer, arg: &str) -> PyResult<Tokens> {
    let (noun, int_noun) = nouns(arg);
    if raw.dimensions() != 1 {
        return Err(value_err(arg, format!("expected a 1-D sequence of {noun}, got a {}-D buffer", raw.dimensions())));
    }
    let fmt = raw.format().to_string_lossy().into_owned();
    // ElementType ignores the byte-order prefix; values stored in the other byte order would
    // be read wrongly, so such buffers are refused (1-byte items have no byte order).
    let foreign = if cfg!(target_endian = "little") { ['>', '!'] } else { ['<', '<'] };
    if raw.item_size() > 1 && fmt.starts_with(foreign) {
        return Err(type_err(
            arg,
            format!("{noun} in non-native byte order (format {fmt:?}); convert them first, e.g. a.astype(a.dtype.newbyteorder('='))"),
        ));
    }
    Ok(match ElementType::from_format(raw.format()) {
        ElementType::SignedInteger { bytes: 8 } => Tokens::I64(typed::<i64>(py, raw, arg)?),
        ElementType::SignedInteger { bytes: 4 } => Tokens::I32(typed::<i32>(py, raw, arg)?),
        ElementType::UnsignedInteger { bytes: 8 } => Tokens::U64(typed::<u64>(py, raw, arg)?),
        ElementType::UnsignedInteger { bytes: 4 } => Tokens::U32(typed::<u32>(py, raw, arg)?),
        ElementType::SignedInteger { bytes: 2 } => Tokens::I32(widened::<i16, i32>(py, raw, arg)?),
        ElementType::SignedInteger { bytes: 1 } => Tokens::I32(widened::<i8, i32>(py, raw, arg)?),
        ElementType::UnsignedInteger { bytes: 2 } => Tokens::U32(widened::<u16, u32>(py, raw, arg)?),
        ElementType::UnsignedInteger { bytes: 1 } => Tokens::U32(widened::<u8, u32>(py, raw, arg)?),
        ElementType::Float { .. } => {
            return Err(type_err(arg, format!("expected {int_noun}, got a float buffer (format {fmt:?})")))
        }
        ElementType::Bool => return Err(type_err(arg, format!("expected {int_noun}, got a bool buffer"))),
        _ => return Err(type_err(arg, format!("expected {int_noun}, got buffer format {fmt:?}"))),
    })
}

/// Convert one Python int to an [`Int`] (any size). `None` if `obj` is not an int (or is bool).
pub fn int_of(obj: &Bound<'_, PyAny>) -> PyResult<Option<Int>> {
    if obj.is_instance_of::<PyBool>() {
        return Ok(None);
    }
    let idx = if obj.is_instance_of::<PyInt>() {
        obj.clone()
    } else if obj.hasattr(pyo3::intern!(obj.py(), "__index__"))? && !obj.is_instance_of::<PyString>() {
        // numpy integer scalars and other integer-likes: their integer value
        match obj.call_method0(pyo3::intern!(obj.py(), "__index__")) {
            Ok(v) => v,
            Err(_) => return Ok(None),
        }
    } else {
        return Ok(None);
    };
    if let Ok(v) = idx.extract::<i64>() {
        return Ok(Some(Int::Small(v)));
    }
    let nbits: usize = idx.call_method0(pyo3::intern!(obj.py(), "bit_length"))?.extract()?;
    let nbytes = (nbits >> 3) + 1;
    let kw = pyo3::types::PyDict::new(obj.py());
    kw.set_item("signed", true)?;
    let le: Vec<u8> = idx.call_method(pyo3::intern!(obj.py(), "to_bytes"), (nbytes, "little"), Some(&kw))?.extract()?;
    Ok(Some(Int::from_le_signed(&le)))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// Extract token ids from `obj` starting at index `start`: a list or tuple of ints, a 1-D
/// integer buffer (numpy array, `array.array`, memoryview), or any other sequence of ints.
pub fn extract_tokens(obj: &Bound<'_, PyAny>, arg: &str, start: usize) -> PyResult<Tokens> {
    extract_token_range(obj, arg, start, None)
}

/// [`extract_tokens`] limited to `obj[start:end]` (`end` = `None`: to the end).
pub fn extract_token_range(obj: &Bound<'_, PyAny>, arg: &str, start: usize, end: Option<usize>) -> PyResult<Tokens> {
    let py = obj.py();
    let check = |len: usize| -> PyResult<usize> {
        let end = end.unwrap_or(len);
        if end > len {
            return Err(value_err("end", format!("{end} is past the end ({len} tokens)")));
        }
        if start > end {
            return Err(value_err("start", format!("{start} is past the end ({end} tokens)")));
        }
        Ok(end)
    };
    // Lists and tuples: the fast path for vLLM-style `list[int]` token ids.
    if let Ok(list) = obj.cast::<PyList>() {
        let end = check(list.len())?;
        if let Some(v) = list_i64(list, start, end) {
            return Ok(Tokens::I64(TokenBuf::Owned(v)));
        }
        return from_items(py, (start..end).map(|i| list.get_item(i)), arg, start);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        let end = check(t.len())?;
        return from_items(py, (start..end).map(|i| t.get_item(i)), arg, start);
    }
    if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 && !obj.is_instance_of::<PyBytes>() {
        let raw = PyUntypedBuffer::get(obj).map_err(|e| {
            value_err(
                arg,
                format!("expected a 1-D sequence of {}, got a buffer it cannot read as one ({e})", nouns(arg).0),
            )
        })?;
        let toks = from_buffer(py, raw, arg)?;
        let end = check(toks.len())?;
        if start == 0 && end == toks.len() {
            return Ok(toks);
        }
        return Ok(match toks {
            Tokens::I32(b) => Tokens::I32(TokenBuf::Owned(b.as_slice()[start..end].to_vec())),
            Tokens::I64(b) => Tokens::I64(TokenBuf::Owned(b.as_slice()[start..end].to_vec())),
            Tokens::U32(b) => Tokens::U32(TokenBuf::Owned(b.as_slice()[start..end].to_vec())),
            Tokens::U64(b) => Tokens::U64(TokenBuf::Owned(b.as_slice()[start..end].to_vec())),
            Tokens::Big(v) => Tokens::Big(v[start..end].to_vec()),
        });
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_err(arg, format!("expected a sequence of {}, got {}", sequence_noun(arg), type_name(obj))));
    }
    let seq: Vec<Bound<'_, PyAny>> = match obj.try_iter() {
        Ok(it) => it.collect::<PyResult<_>>()?,
        Err(_) => {
            return Err(type_err(arg, format!("expected a sequence of {}, got {}", sequence_noun(arg), type_name(obj))))
        }
    };
    let end = check(seq.len())?;
    from_items(py, seq.into_iter().take(end).skip(start).map(Ok), arg, start)
}

/// `obj[start:end]` as owned `i64` token ids, read without a Python object per token: a list
/// of ints that fit in `i64` (exact ints of up to 62 bits read in place, [`list_i64`]), or a 1-D integer buffer (vLLM 0.34's
/// `TokenBuffer`, an `array('i')`; numpy arrays; `array('q')`...) read in place and widened.
/// `Ok(None)`: some other input (a tuple, ints beyond 62 bits in a list, `uint64` ids beyond
/// `i64`): the caller takes the general path ([`extract_token_range`]), which reads them
/// exactly. A buffer of floats or bools, or one not 1-D, is the same error as there.
pub fn owned_i64_range(obj: &Bound<'_, PyAny>, arg: &str, start: usize, end: usize) -> PyResult<Option<Vec<i64>>> {
    if let Ok(list) = obj.cast::<PyList>() {
        if end > list.len() || start > end {
            return Ok(None); // the general path raises the error
        }
        if let Some(v) = list_i64(list, start, end) {
            return Ok(Some(v));
        }
        // integer-likes (numpy scalars) in the list: read one by one, as before
        return Ok(match extract_token_range(obj, arg, start, Some(end))? {
            Tokens::I64(TokenBuf::Owned(v)) => Some(v),
            _ => None,
        });
    }
    // SAFETY: `obj` is a live object; PyObject_CheckBuffer only reads its type.
    if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 0 || obj.is_instance_of::<PyBytes>() {
        return Ok(None);
    }
    let Ok(raw) = PyUntypedBuffer::get(obj) else { return Ok(None) };
    let toks = from_buffer(obj.py(), raw, arg)?;
    if end > toks.len() || start > end {
        return Ok(None);
    }
    Ok(match &toks {
        Tokens::I32(b) => Some(b.as_slice()[start..end].iter().map(|&t| i64::from(t)).collect()),
        Tokens::I64(b) => Some(b.as_slice()[start..end].to_vec()),
        Tokens::U32(b) => Some(b.as_slice()[start..end].iter().map(|&t| i64::from(t)).collect()),
        Tokens::U64(b) => b.as_slice()[start..end].iter().map(|&t| i64::try_from(t).ok()).collect(),
        Tokens::Big(_) => None,
    })
}

fn from_items<'py>(
    _py: Python<'py>,
    items: impl ExactSizeIterator<Item = PyResult<Bound<'py, PyAny>>>,
    arg: &str,
    start: usize,
) -> PyResult<Tokens> {
    let mut small: Vec<i64> = Vec::with_capacity(items.len());
    let mut big: Option<Vec<Int>> = None;
    for (k, item) in items.enumerate() {
        let item = item?;
        // Exact ints that fit in i64: read straight from the int object.
        let fast = if unsafe { ffi::PyLong_CheckExact(item.as_ptr()) } != 0 {
            // SAFETY: an exact int object, kept alive by `item`.
            unsafe { exact_int_i64(item.as_ptr()) }
        } else {
            None
        };
        let v = match fast {
            Some(v) => Int::Small(v),
            None => match int_of(&item)? {
                Some(i) => i,
                None => {
                    return Err(type_err(
                        &format!("{arg}[{}]", start + k),
                        format!("{} must be int, got {}", nouns(arg).0, type_name(&item)),
                    ))
                }
            },
        };
        match (&mut big, v) {
            (Some(b), v) => b.push(v),
            (None, Int::Small(x)) => small.push(x),
            (None, v) => {
                let mut b: Vec<Int> = small.iter().map(|&x| Int::Small(x)).collect();
                b.push(v);
                big = Some(b);
            }
        }
    }
    Ok(match big {
        Some(b) => Tokens::Big(b),
        None => Tokens::I64(TokenBuf::Owned(small)),
    })
}

const MAX_DEPTH: usize = 32;

/// Convert a hashable Python object (None, bool, int, str, bytes, tuple) to a [`Value`],
/// recording object identity for pickle's memo.
pub fn to_value(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Value> {
    to_value_depth(obj, arg, 0)
}

fn ident(obj: &Bound<'_, PyAny>) -> ObjId {
    obj.as_ptr() as usize as ObjId
}

fn to_value_depth(obj: &Bound<'_, PyAny>, arg: &str, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(value_err(arg, format!("nested deeper than {MAX_DEPTH} levels")));
    }
    if obj.is_none() {
        return Ok(Value::None);
    }
    if let Ok(b) = obj.cast_exact::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(t) = obj.cast_exact::<PyTuple>() {
        let mut items = Vec::with_capacity(t.len());
        for (i, it) in t.iter().enumerate() {
            items.push(to_value_depth(&it, &format!("{arg}[{i}]"), depth + 1)?);
        }
        return Ok(Value::Tuple { id: ident(obj), items });
    }
    if let Ok(s) = obj.cast_exact::<PyString>() {
        return Ok(match s.to_str() {
            Ok(st) => Value::Str { id: ident(obj), data: st.as_bytes().to_vec(), utf8_ok: true },
            Err(_) => {
                // lone surrogates: pickle writes them with 'surrogatepass'
                let enc = obj.call_method1(pyo3::intern!(obj.py(), "encode"), ("utf-8", "surrogatepass"))?;
                Value::Str { id: ident(obj), data: enc.extract::<Vec<u8>>()?, utf8_ok: false }
            }
        });
    }
    if let Ok(b) = obj.cast_exact::<PyBytes>() {
        return Ok(Value::Bytes { id: ident(obj), data: b.as_bytes().to_vec() });
    }
    if obj.cast_exact::<PyInt>().is_ok() {
        if let Some(i) = int_of(obj)? {
            return Ok(Value::Int(i));
        }
    }
    Err(type_err(
        arg,
        format!(
            "cannot hash an object of type {}; block-hash inputs hold only None, bool, int, str, bytes and tuples of those",
            type_name(obj)
        ),
    ))
}

/// A new `bytes` object holding `data`; `MemoryError` (not a panic, as `PyBytes::new` would)
/// if it cannot be allocated.
pub fn bytes_object<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    // SAFETY: `data` is valid for `len` bytes; a non-NULL result is a new reference to a
    // bytes object, NULL comes with an exception set.
    unsafe {
        let p = ffi::PyBytes_FromStringAndSize(data.as_ptr().cast(), data.len() as ffi::Py_ssize_t);
        if p.is_null() {
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, p).cast_into_unchecked())
    }
}
