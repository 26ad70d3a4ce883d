//! Binding helpers for retention (priorities, pins, the clock): reading a request's
//! `retention` / `retention_priority`, and reading the manager's clock before an action.

use super::errors::{type_err, value_err, IntoPy};
use super::fields::Field;
use crate::manager::retention::{RequestRetention, RetentionRange, RetentionState};
use crate::pool::block_pool::BlockPool;
use crate::pool::retention::{check_duration, check_priority};
use pyo3::prelude::*;

fn int_of(v: &Bound<'_, PyAny>, arg: &str) -> PyResult<i64> {
    if v.is_instance_of::<pyo3::types::PyBool>() {
        return Err(type_err(arg, "must be an int, not a bool"));
    }
    v.extract::<i64>().map_err(|_| type_err(arg, "must be an int"))
}

/// A duration in seconds (None allowed): finite and >= 0.
pub fn duration_of(v: &Bound<'_, PyAny>, arg: &str) -> PyResult<Option<f64>> {
    if v.is_none() {
        return Ok(None);
    }
    if v.is_instance_of::<pyo3::types::PyBool>() {
        return Err(type_err(arg, "must be a number of seconds, not a bool"));
    }
    let d: f64 = v.extract().map_err(|_| type_err(arg, "must be a number of seconds or None"))?;
    check_duration(d, arg).py_err().map(Some)
}

/// A priority 0–100.
pub fn priority_of(v: &Bound<'_, PyAny>, arg: &str) -> PyResult<u8> {
    check_priority(int_of(v, arg)?, arg).py_err()
}

/// The request's retention (`request.retention`: a sequence of `(start, end, priority,
/// duration_s)`, and `request.retention_priority`: an int), checked against its prompt;
/// None when it has neither.
pub fn request_retention(request: &Bound<'_, PyAny>, num_prompt_tokens: usize) -> PyResult<Option<RequestRetention>> {
    let py = request.py();
    let ranges = match request.getattr(Field::Retention.interned(py)) {
        Ok(r) if !r.is_none() => Some(r),
        _ => None,
    };
    let prio = match request.getattr(Field::RetentionPriority.interned(py)) {
        Ok(p) if !p.is_none() => Some(priority_of(&p, "request.retention_priority")?),
        _ => None,
    };
    if ranges.is_none() && prio.is_none() {
        return Ok(None);
    }
    let mut out = RequestRetention { ranges: Vec::new(), priority: prio.map(|p| (p, None)) };
    if let Some(r) = ranges {
        if r.is_instance_of::<pyo3::types::PyString>() || r.is_instance_of::<pyo3::types::PyBytes>() {
            return Err(type_err("request.retention", "expected a list of (start, end, priority, duration_s)"));
        }
        for (i, item) in r
            .try_iter()
            .map_err(|_| type_err("request.retention", "expected a list of (start, end, priority, duration_s)"))?
            .enumerate()
        {
            let item = item?;
            let arg = format!("request.retention[{i}]");
            let t: Vec<Bound<'_, PyAny>> =
                item.extract().map_err(|_| type_err(&arg, "expected (start, end, priority, duration_s)"))?;
            if t.len() != 4 {
                return Err(value_err(
                    &arg,
                    format!("expected (start, end, priority, duration_s), got {} items", t.len()),
                ));
            }
            let start = int_of(&t[0], &format!("{arg}.start"))?;
            let end = int_of(&t[1], &format!("{arg}.end"))?;
            if start < 0 || end < 0 {
                return Err(value_err(&arg, format!("token range [{start}, {end}) must not be negative")));
            }
            out.ranges.push(RetentionRange {
                start: start as usize,
                end: end as usize,
                priority: priority_of(&t[2], &format!("{arg}.priority"))?,
                duration_s: duration_of(&t[3], &format!("{arg}.duration_s"))?,
            });
        }
    }
    out.check(num_prompt_tokens).map_err(|e| value_err("request.retention", e))?;
    Ok(Some(out))
}

/// `check_retention(request, num_prompt_tokens)`: check a request's `retention` and
/// `retention_priority` as a manager reads them (`kvblock.Request` calls it when built, so a
/// bad setting fails there, not at the first `allocate_slots`).
#[pyfunction]
pub fn check_retention(request: &Bound<'_, PyAny>, num_prompt_tokens: usize) -> PyResult<()> {
    request_retention(request, num_prompt_tokens).map(|_| ())
}

/// Read the clock (`clock()`, seconds as a float) if retention or a TTL pin needs it: apply
/// the priorities that ran out and the pins that expired. Returns the reading, if taken.
pub fn tick(
    py: Python<'_>,
    clock: Option<&Py<PyAny>>,
    pool: &mut BlockPool,
    state: &mut RetentionState,
) -> PyResult<Option<f64>> {
    if pool.retention().is_none() && !state.has_ttl_pins() {
        return Ok(None);
    }
    let now = read_clock(py, clock)?;
    pool.set_time(now).py_err()?;
    state.expire(pool, now).py_err()?;
    Ok(Some(now))
}

/// One clock reading.
pub fn read_clock(py: Python<'_>, clock: Option<&Py<PyAny>>) -> PyResult<f64> {
    let Some(c) = clock else {
        return Ok(std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0));
    };
    let v = c.call0(py)?;
    let now: f64 = v.extract(py).map_err(|_| type_err("clock", "must return a number of seconds"))?;
    if !now.is_finite() {
        return Err(value_err("clock", format!("returned {now}, not a finite time")));
    }
    Ok(now)
}
