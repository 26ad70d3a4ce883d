//! vLLM 0.33.0's KV cache manager (spec §5, §6): per-request block tables for every KV-cache
//! group of a model over one block pool, prefix-cache lookup, `allocate_slots`, caching and
//! freeing, so that one Python call performs one scheduler action.
//!
//! * [`spec`]: what a group is (full attention, sliding window, chunked local, Mamba, cross
//!   attention, ...), and the manager's configuration.
//! * [`group_state`]: the data of one group that the coordinator and every kind share.
//! * [`single_type`]: vLLM's `SingleTypeKVCacheManager`, the behaviour every kind shares,
//!   dispatching to one file per kind: [`full_attention`] (with R-SWA and circular buffers),
//!   [`sliding_window`], [`chunked_local`], [`mamba`]; cross attention is never cached and
//!   only allocates (in [`single_type`]).
//! * [`hisparse`]: the rules of HiSparse's source, resident and hot groups (the books are in
//!   [`crate::hisparse`]).
//! * [`hisparse_layout`]: which groups of a configuration are HiSparse's host, resident and
//!   hot groups, with vLLM's configuration errors.
//! * [`hisparse_tier`]: the host pool and the residency a manager with HiSparse groups
//!   holds, and the residency's view of the manager.
//! * [`coordinator`]: vLLM's `KVCacheCoordinator` (no prefix cache, unitary, hybrid);
//!   [`coordinator_hisparse`] its per-group calls for the HiSparse kinds.
//! * [`kv_cache_manager`]: vLLM's `KVCacheManager` on top.
//! * [`requests`]: the request id -> slot table.
//! * [`release`]: the rules that differ between vLLM releases (0.33's by default).
//! * [`retention`]: request retention priorities and pinned prefixes (kvblock's own API).
//! * [`hit_verify`]: verify on hit, exact content records of cached blocks (kvblock's own API).

pub mod chunked_local;
pub mod coordinator;
pub mod coordinator_hisparse;
pub mod full_attention;
pub mod group_state;
pub mod hisparse;
pub mod hisparse_layout;
pub mod hisparse_tier;
pub mod hit_verify;
pub mod kv_cache_manager;
pub mod mamba;
pub mod release;
pub mod requests;
pub mod retention;
pub mod single_type;
pub mod sliding_window;
pub mod spec;

pub use crate::hashing::source::HashSource;
pub use kv_cache_manager::{AllocArgs, BoundaryStep, KVCacheManager, RequestView};
