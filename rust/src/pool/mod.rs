//! The block pool (vLLM's `BlockPool`): the intrusive free queue, the hash -> block map, the
//! block arena with reference counts, and the KV events it records.

pub mod block_pool;
pub mod cache_map;
pub mod events;
pub mod free_queue;
pub mod link;
pub mod residency;
pub mod retention;
pub mod slot_table;
