//! The CPython fast paths: every place the bindings read or write interpreter internals by
//! layout or take a shortcut past PyO3's ordinary attribute access and argument parsing, in one
//! room, behind one switch.
//!
//! - [`entry`]: `METH_FASTCALL` entries for vLLM's no-op `allocate_slots` / `cache_blocks`
//!   decode-step calls, past PyO3's keyword matching;
//! - [`block_ids_method`]: a `METH_FASTCALL` `KVCacheBlocks.get_block_ids` for the scheduler's
//!   per-request `get_block_ids(allow_none=True)`;
//! - [`slots`]: `__slots__` fields read and written by byte offset (`kvblock.Request`), and
//!   `KVCacheBlocks` built with `tp_alloc`;
//! - [`instance_dict`]: plain request attributes read from the instance `__dict__`
//!   (vLLM's `Request`), guarded by the type's version tag;
//! - [`slot_cache`]: a request's manager slot found by its object address;
//! - [`ints`]: small `int`s read from their digits;
//! - `request_id_str` (`manager/mod.rs`) reads a compact ASCII `str` in place (checked here).
//!
//! **The switch:** `KVBLOCK_NO_FAST_PATHS=1` (any value but empty or `0`) in the environment
//! when `kvblock._core` is imported turns them all off: fields are read with `getattr`, calls
//! take PyO3's generated entries, ints and strings are read through the C API, and results
//! are the same (`tests/test_fast_paths.py` runs one workload both ways; CI runs the manager,
//! pool, request, hashing, lockstep and vLLM plugin tests with the switch on). It is read
//! once per process; `kvblock._core.FAST_PATHS` says which way it went.
//!
//! The public C-API macros the bindings use elsewhere (`PyList_GET_ITEM`, `PyBytes_AS_STRING`,
//! `PyLong_CheckExact`) are the interpreter's documented API, not fast paths.

pub mod block_ids_method;
pub mod entry;
pub mod instance_dict;
pub mod ints;
pub mod slot_cache;
pub mod slots;

use std::sync::OnceLock;

/// The environment variable that turns every fast path off.
pub const SWITCH: &str = "KVBLOCK_NO_FAST_PATHS";

/// True unless [`SWITCH`] is set (to anything but empty or `0`), read once per process.
#[inline(always)]
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(SWITCH).is_none_or(|v| v.is_empty() || v == "0"))
}
