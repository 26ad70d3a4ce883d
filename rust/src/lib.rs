//! kvblock core: vLLM-identical prefix-caching KV block management.
//!
//! This crate has no Python dependency unless the `python` feature is on; the bindings live in
//! `py` only.
//!
//! * [`hashing`]: chained block hashing (serializers, digests, the digest memo).
//! * [`pool`]: the block pool (free queue, cache map, arena, events).
//! * [`manager`]: the KV cache manager (per-request block tables, allocation, caching).
//! * [`hisparse`]: vLLM's HiSparse residency (host tier, spills, released GPU pages).
//! * [`index`]: the fleet prefix index (block hash -> holding instances, from KV events).
//! * [`capacity`]: capacity planning (hit-rate curves in one pass, the Belady bound).
//! * [`prefetch`], [`huge_pages`]: hints to the CPU and the kernel about memory reads.

pub mod capacity;
pub mod error;
pub mod hashing;
pub mod hisparse;
pub mod huge_pages;
pub mod index;
pub mod manager;
pub mod pool;
pub mod prefetch;

#[cfg(feature = "python")]
mod py;
