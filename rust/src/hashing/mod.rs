//! Chained block hashing, byte-identical to vLLM 0.33.0: the serializers (pickle protocol 5,
//! canonical CBOR) over the values vLLM hashes, SHA-256 / XXH3-128 digests, the chain over a
//! token slice, and the digest memo of the request hasher.

pub mod cbor;
mod chain;
pub mod digest_memo;
pub mod pickle;
pub mod source;
pub mod token_simd;
pub mod value;

pub use chain::*;
