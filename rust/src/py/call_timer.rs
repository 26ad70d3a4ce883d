//! `CallClock` / `TimedCall`: time spent inside calls to chosen callables, for the benches
//! that report what share of a vLLM scheduler step its KV cache manager takes. Built only with
//! the `bench-timers` cargo feature (`make bench`); the wheel and `make install` leave it out.
//!
//! A Python wrapper (`def timed(*args, **kwargs)`) costs a frame, two `perf_counter_ns()`
//! calls and its bookkeeping inside the interval it times: 250-470 ns a call on a 2-vCPU VM,
//! as much as the manager call it wraps, and varying from pass to pass, so the share left after
//! subtracting a calibration swung between 0.6% and 6.3% from pass to pass. A `TimedCall`
//! unpacks the arguments before it reads the clock and then makes the same vectorcall the
//! caller would have made, so the interval holds the call and two clock reads
//! ([`PyCallClock::overhead_ns`] measures those).

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// The shared clock of a set of timed callables: total time inside their outermost calls.
/// A call made while a timed call runs (one wrapped method calling another, or a call from
/// another thread while the first waits without the GIL) runs untimed, so no time is counted
/// twice; the benches time one thread.
#[pyclass(module = "kvblock._core", name = "CallClock", frozen)]
pub struct PyCallClock {
    /// 1 while a timed call runs (the GIL serialises every access).
    depth: AtomicU64,
    ns: AtomicU64,
    calls: AtomicU64,
}

/// A callable that times its calls on a [`PyCallClock`]. Each call's time goes to one of two
/// buckets: 0 when the result is None or is the `empty` object given at wrapping (for a KV
/// cache manager: a call that allocated nothing) or the call raised, 1 otherwise.
#[pyclass(module = "kvblock._core", name = "TimedCall", frozen)]
pub struct PyTimedCall {
    clock: Py<PyCallClock>,
    func: Py<PyAny>,
    empty: Option<Py<PyAny>>,
    ns: [AtomicU64; 2],
    calls: [AtomicU64; 2],
}

#[pymethods]
impl PyCallClock {
    #[new]
    fn new() -> Self {
        PyCallClock { depth: AtomicU64::new(0), ns: AtomicU64::new(0), calls: AtomicU64::new(0) }
    }

    /// `func` timed on this clock; `empty`: the result that counts as "nothing done".
    #[pyo3(signature = (func, empty=None))]
    fn wrap(slf: &Bound<'_, Self>, func: Bound<'_, PyAny>, empty: Option<Bound<'_, PyAny>>) -> PyResult<PyTimedCall> {
        if !func.is_callable() {
            return Err(pyo3::exceptions::PyTypeError::new_err("func must be callable"));
        }
        Ok(PyTimedCall {
            clock: slf.clone().unbind(),
            func: func.unbind(),
            empty: empty.map(Bound::unbind),
            ns: [AtomicU64::new(0), AtomicU64::new(0)],
            calls: [AtomicU64::new(0), AtomicU64::new(0)],
        })
    }

    /// Nanoseconds inside outermost timed calls, two clock reads each included.
    #[getter]
    fn ns(&self) -> u64 {
        self.ns.load(Relaxed)
    }

    /// Outermost timed calls made.
    #[getter]
    fn calls(&self) -> u64 {
        self.calls.load(Relaxed)
    }

    /// The least, over `samples` tries, of the nanoseconds between two clock reads with
    /// nothing between them: the clock's own share of each timed interval.
    #[pyo3(signature = (samples=10_000))]
    fn overhead_ns(&self, samples: u32) -> u64 {
        (0..samples.max(1))
            .map(|_| {
                let t0 = Instant::now();
                let t1 = Instant::now();
                std::hint::black_box(t1.duration_since(t0)).as_nanos() as u64
            })
            .min()
            .unwrap_or(0)
    }
}

impl PyTimedCall {
    fn record(&self, bucket: usize, ns: u64) {
        let clock = self.clock.get();
        clock.ns.fetch_add(ns, Relaxed);
        clock.calls.fetch_add(1, Relaxed);
        self.ns[bucket].fetch_add(ns, Relaxed);
        self.calls[bucket].fetch_add(1, Relaxed);
    }
}

#[pymethods]
impl PyTimedCall {
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // the caller's vectorcall, rebuilt: positional arguments, then keyword values, with
        // the keyword names in a tuple (every object stays owned here until the call returns)
        let mut keep: Vec<Bound<'py, PyAny>> = args.iter().collect();
        let nargs = keep.len();
        let mut names = Vec::new();
        if let Some(kw) = kwargs {
            for (k, v) in kw.iter() {
                names.push(k);
                keep.push(v);
            }
        }
        let kwnames = if names.is_empty() { None } else { Some(PyTuple::new(py, names)?) };
        let stack: Vec<*mut ffi::PyObject> = keep.iter().map(|o| o.as_ptr()).collect();
        let kwnames_ptr = kwnames.as_ref().map_or(std::ptr::null_mut(), |t| t.as_ptr());
        let clock = self.clock.get();
        let outermost = clock.depth.load(Relaxed) == 0;
        if outermost {
            clock.depth.store(1, Relaxed);
        }
        let t0 = Instant::now();
        // SAFETY: `stack` holds `nargs` positional arguments then one value per name in
        // `kwnames` (a tuple of str, or NULL), all kept alive by `keep` / `kwnames`; the GIL
        // is held.
        let raw = unsafe { ffi::PyObject_Vectorcall(self.func.as_ptr(), stack.as_ptr(), nargs, kwnames_ptr) };
        let dt = t0.elapsed().as_nanos() as u64;
        if !outermost {
            // SAFETY: a new reference or NULL with an exception set, as vectorcall returns.
            return unsafe { Bound::from_owned_ptr_or_err(py, raw) };
        }
        clock.depth.store(0, Relaxed);
        // SAFETY: as above.
        let res = unsafe { Bound::from_owned_ptr_or_err(py, raw) };
        let nothing = match &res {
            Ok(r) => r.is_none() || self.empty.as_ref().is_some_and(|e| e.as_ptr() == r.as_ptr()),
            Err(_) => true,
        };
        self.record(if nothing { 0 } else { 1 }, dt);
        res
    }

    /// `(ns, calls)` of the calls whose result was None or `empty` (bucket 0) and of the
    /// others (bucket 1): `((ns0, calls0), (ns1, calls1))`.
    fn totals(&self) -> ((u64, u64), (u64, u64)) {
        let b = |i: usize| (self.ns[i].load(Relaxed), self.calls[i].load(Relaxed));
        (b(0), b(1))
    }

    /// The callable timed.
    #[getter]
    fn func(&self, py: Python<'_>) -> Py<PyAny> {
        self.func.clone_ref(py)
    }

    /// For the garbage collector: a wrapped function that refers back to its wrapper (a
    /// closure, an instance attribute) makes a cycle.
    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.clock)?;
        visit.call(&self.func)?;
        if let Some(e) = &self.empty {
            visit.call(e)?;
        }
        Ok(())
    }
}
