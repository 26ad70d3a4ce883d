//! Verify on hit, the binding's side: read what identifies a request's blocks (its token ids
//! and the extra keys its block hasher mixes in) into a
//! [`crate::manager::hit_verify::BlockContent`], before the call changes anything.

use super::convert::extract_token_range;
use super::errors::{type_err, value_err};
use super::fields::{Field, RequestFields};
use super::hashing::extra_of;
use crate::hashing::value::TokenId;
use crate::manager::hit_verify::{encode_extra_keys, BlockContent};
use pyo3::prelude::*;
use pyo3::types::PyList;

/// How the binding reads request contents: the hash block size, the lookahead tokens each
/// block hash covers, and `extra_keys(request, start, num_blocks, block_size, lookahead) ->
/// list` (`kvblock.hashing._request_extra_keys`: what the block hasher mixes in per block).
pub struct ContentReader {
    pub block_size: usize,
    pub lookahead: usize,
    pub extra_keys: Py<PyAny>,
}

impl ContentReader {
    /// Blocks `first..end` of `request` (clipped to its full blocks): their tokens (a block
    /// holding one beyond int64 is marked unrepresentable) and, when the request has any,
    /// their extra keys.
    ///
    /// Raises `TypeError` for a request without `_all_token_ids` or with token ids that are
    /// not ints, and whatever `extra_keys` raises; nothing has changed then.
    pub fn read(
        &self,
        fields: &RequestFields,
        request: &Bound<'_, PyAny>,
        first: usize,
        end: usize,
    ) -> PyResult<BlockContent> {
        let py = request.py();
        let bs = self.block_size;
        let all = fields
            .get_opt(request, Field::AllTokenIds)?
            .ok_or_else(|| type_err("request", "verify_hits reads request._all_token_ids, which it lacks"))?;
        let end = end.min(all.len()? / bs);
        if first >= end {
            return Ok(BlockContent { first, tokens: Vec::new(), unrepresentable: None, extras: None });
        }
        let toks = extract_token_range(&all, "request._all_token_ids", first * bs, Some(end * bs))?;
        let mut unrepresentable: Option<Vec<bool>> = None;
        let tokens: Vec<i64> = crate::with_token_slice!(&toks, |s| s
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                TokenId::as_i64(t).unwrap_or_else(|_| {
                    unrepresentable.get_or_insert_with(|| vec![false; end - first])[i / bs] = true;
                    0
                })
            })
            .collect());
        let extras = if self.lookahead > 0 || fields.has_extra_keys(request)? {
            let n = end - first;
            let list = self.extra_keys.bind(py).call1((request, first * bs, n, bs, self.lookahead))?;
            let list = list.cast_into::<PyList>().map_err(|_| type_err("extra_keys", "must return a list"))?;
            if list.len() != n {
                return Err(value_err("extra_keys", format!("returned {} entries for {n} blocks", list.len())));
            }
            let mut out = Vec::with_capacity(n);
            for (i, e) in list.iter().enumerate() {
                out.push(extra_of(Some(&e), &format!("extra_keys[{i}]"))?.map(|v| encode_extra_keys(&v)));
            }
            Some(out)
        } else {
            None
        };
        Ok(BlockContent { first, tokens, unrepresentable, extras })
    }
}
