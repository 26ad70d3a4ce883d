//! vLLM's HiSparse, scheduler side (`vllm/v1/hisparse/coordinator.py` and the HiSparse
//! managers of `single_type_kv_cache_manager.py`, 0.32 to 0.34): which pages of a request are
//! GPU-resident, which have a durable host copy, the spills between the two tiers and the
//! GPU blocks released while still read (the pool's `unpin_blocks`). Worker-side copies are
//! vLLM's; this module only decides and keeps the books.
//!
//! * [`residency`]: the coordinator's state and transitions ([`residency::Residency`]),
//!   driven through an [`residency::Env`] that gives the groups' block tables, the device
//!   and host pools and the host group's publication. Which groups of a manager
//!   configuration are the host, resident and hot groups ([`residency::Layout`]) is read in
//!   [`crate::manager::hisparse_layout`]: this module knows pools, not managers.

pub mod residency;
