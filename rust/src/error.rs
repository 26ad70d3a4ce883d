//! One error type for the whole core. Every failure that input can cause is an `Err`, never a
//! panic; the binding layer maps each variant to a Python exception class.

use thiserror::Error;

/// Errors of the kvblock core.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    /// An argument has the right type but a value we refuse (maps to `ValueError`).
    #[error("{0}")]
    Value(String),
    /// An argument has a type we cannot hash or store (maps to `TypeError`).
    #[error("{0}")]
    Type(String),
    /// A block id, request or index that does not exist (maps to `ValueError`; `KeyError`
    /// where vLLM raises one).
    #[error("{0}")]
    NotFound(String),
    /// The pool cannot hand out that many blocks (maps to `ValueError`, as vLLM raises).
    #[error("Cannot get {requested} free blocks from the pool")]
    NotEnoughFreeBlocks { requested: usize, free: usize },
    /// The free queue is empty (vLLM: `ValueError("No free blocks available")`).
    #[error("No free blocks available")]
    NoFreeBlocks,
    /// An operation that is illegal in the current state (maps to `RuntimeError`).
    #[error("{0}")]
    State(String),
    /// A precondition vLLM asserts (maps to `AssertionError`, as vLLM's `assert` raises).
    #[error("{0}")]
    Assertion(String),
    /// Hit blocks evicted and reused since the lookup that returned them (maps to
    /// `kvblock.StaleHitError`, a `ValueError`).
    #[error("{0}")]
    StaleHit(String),
    /// An index past a sequence, where vLLM's own code indexes a list past its end (maps to
    /// `IndexError`; vLLM's callers only, never kvblock's own API).
    #[error("{0}")]
    Index(String),
    /// An operation vLLM's class for this group kind does not implement (maps to
    /// `NotImplementedError`, as vLLM raises).
    #[error("{0}")]
    NotImplemented(String),
    /// Memory for the structure could not be allocated (maps to `MemoryError`).
    #[error("{0}")]
    Memory(String),
}

/// Result alias of the core.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// A `ValueError`-kind error naming the offending argument.
    pub fn value(arg: &str, msg: impl std::fmt::Display) -> Self {
        Error::Value(format!("{arg}: {msg}"))
    }
    /// A vector of `n` copies of `value`, or `Error::Memory` if it cannot be allocated.
    pub fn try_vec<T: Clone>(what: &str, n: usize, value: T) -> Result<Vec<T>> {
        let mut v = Vec::new();
        v.try_reserve_exact(n).map_err(|_| Error::Memory(format!("cannot allocate {what} for {n} blocks")))?;
        v.resize(n, value);
        Ok(v)
    }

    /// A `TypeError`-kind error naming the offending argument.
    pub fn type_(arg: &str, msg: impl std::fmt::Display) -> Self {
        Error::Type(format!("{arg}: {msg}"))
    }
}
