//! kvblock core: vLLM-identical prefix-caching KV block management.
//!
//! This crate has no Python dependency unless the `python` feature is on; the bindings live in
//! [`py`] only.

pub mod block_pool;
pub mod cache_map;
pub mod cbor;
pub mod digest_memo;
pub mod error;
pub mod events;
pub mod free_queue;
pub mod hashing;
pub mod manager;
pub mod pickle;
pub mod requests;
pub mod token_simd;
pub mod value;

#[cfg(feature = "python")]
mod py;
