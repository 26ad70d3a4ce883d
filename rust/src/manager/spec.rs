//! What a KV-cache group is: the Rust mirror of vLLM 0.33.0's `KVCacheSpec` kinds that
//! kvblock manages (spec §6.1), and the configuration of a manager built over them.

use crate::error::{Error, Result};
use crate::manager::release::ReleaseRules;

/// Mamba state caching (vLLM's `mamba_cache_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MambaMode {
    /// One running state per request; no prefix caching.
    None,
    /// States at block boundaries, cacheable ("align").
    Align,
}

/// The attention type of a group, with its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Full attention (vLLM's `FullAttentionSpec`, `MLAAttentionSpec`,
    /// `HiddenStateCacheSpec`, `SinkFullAttentionSpec`): every block is kept.
    FullAttention,
    /// Reference sliding-window attention (`RSWASpec`): full attention that frees the gap
    /// between the prompt and a decode window of `window` tokens.
    Rswa { window: usize },
    /// Sliding-window attention (`SlidingWindowSpec`, `SlidingWindowMLASpec`).
    SlidingWindow { window: usize, extra_retained_tokens: usize },
    /// Chunked local attention (`ChunkedLocalAttentionSpec`).
    ChunkedLocal { chunk: usize },
    /// Mamba / linear attention state (`MambaSpec`).
    Mamba {
        mode: MambaMode,
        num_speculative_blocks: usize,
        num_prefill_checkpoint_blocks: usize,
        prefill_checkpoint_alignment: Option<usize>,
    },
    /// Cross attention of encoder-decoder models (`CrossAttentionSpec`): never cached.
    CrossAttention,
    /// One ring block per request, never cached (`CircularBufferSpec`).
    CircularBuffer,
    /// HiSparse's host tier (a `FullAttentionSpec` group with role `HISPARSE_SOURCE`,
    /// `HiSparseSourceManager`): full attention on the host pool, its publication deferred
    /// to the residency. Rules: [`crate::manager::hisparse`].
    HiSparseSource,
    /// HiSparse's GPU-resident pages (`HiSparseResidentSpec`, `HiSparseResidentManager`):
    /// never cached, host pages not allocated, an admission cap.
    HiSparseResident,
    /// HiSparse's hot region (`HiSparseHotSpec`, `HiSparseHotManager`): `blocks_per_request`
    /// blocks once the request reads host-backed history; never cached.
    HiSparseHot { blocks_per_request: usize },
}

impl Kind {
    /// vLLM's `supports_fine_grained_hash_lookup` of the manager class.
    pub fn supports_fine_grained_hash_lookup(&self) -> bool {
        matches!(self, Kind::FullAttention | Kind::Rswa { .. } | Kind::Mamba { .. } | Kind::HiSparseSource)
    }

    /// True for the kinds whose hit lookup is the full-attention scan (vLLM's
    /// `isinstance(spec, FullAttentionSpec)`).
    pub fn is_full_attention(&self) -> bool {
        matches!(self, Kind::FullAttention | Kind::Rswa { .. } | Kind::HiSparseSource)
    }

    /// True for HiSparse's three kinds (source, resident, hot).
    pub fn is_hisparse(&self) -> bool {
        matches!(self, Kind::HiSparseSource | Kind::HiSparseResident | Kind::HiSparseHot { .. })
    }

    /// True for the kinds whose `cache_blocks` caches nothing and reads no hash (circular
    /// buffer, HiSparse resident and hot; cross attention refuses caching).
    pub fn caches_nothing(&self) -> bool {
        matches!(self, Kind::CircularBuffer | Kind::HiSparseResident | Kind::HiSparseHot { .. } | Kind::CrossAttention)
    }

    /// True for a Mamba group.
    pub fn is_mamba(&self) -> bool {
        matches!(self, Kind::Mamba { .. })
    }
}

/// One KV-cache group.
#[derive(Clone, Debug)]
pub struct GroupSpec {
    /// The attention type.
    pub kind: Kind,
    /// Tokens per block (the spec's `block_size`, before DCP scaling).
    pub block_size: usize,
    /// Whether the group takes part in prefix caching (`spec.prefix_cacheable`).
    pub prefix_cacheable: bool,
    /// Whether DCP shards the group's tokens (`spec.dcp_sharded`).
    pub dcp_sharded: bool,
    /// An EAGLE/MTP draft group (`KVCacheGroupSpec.is_eagle_group`).
    pub is_eagle_group: bool,
    /// An attention spec whose new blocks the worker zeroes when zeroing is on
    /// (`isinstance(spec, AttentionSpec)` and not a circular buffer).
    pub zeroed: bool,
    /// Groups with equal specs (and kind) share a class: they are looked up together.
    pub spec_class: u32,
}

/// The configuration of a KV cache manager (vLLM's `KVCacheManager` / coordinator
/// constructor arguments that shape the managers).
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    pub groups: Vec<GroupSpec>,
    pub num_blocks: usize,
    pub max_model_len: usize,
    pub max_in_flight_tokens: usize,
    pub scheduler_block_size: usize,
    pub hash_block_size: usize,
    pub enable_caching: bool,
    pub use_eagle: bool,
    pub num_hash_lookahead_tokens: usize,
    pub num_prefill_lookahead: usize,
    pub dcp_world_size: usize,
    pub pcp_world_size: usize,
    pub watermark_blocks: usize,
    pub enable_kv_cache_events: bool,
    /// `needs_kv_cache_zeroing`: Mamba layers or mixed-precision caches.
    pub needs_kv_cache_zeroing: bool,
    /// `kv_cache_config.prefix_cache_retention_interval`.
    pub retention_interval: Option<usize>,
    /// `enable_mamba_shared_prefix_checkpoint`.
    pub enable_mamba_shared_prefix_checkpoint: bool,
    /// Whose API the manager serves: see [`Caller`].
    pub caller: Caller,
    /// The installed vLLM release's rules where releases differ (0.33's by default).
    pub rules: ReleaseRules,
    /// `kv_cache_config.hisparse_host_num_blocks`: the host pool's blocks (the null block
    /// included) when a group is HiSparse's source group (None: no host tier).
    pub hisparse_host_num_blocks: Option<usize>,
    /// vLLM 0.34's HiSparse `import_step_tokens` (the source group's admission count sizes an
    /// external import this much further and holds import reservations); None before 0.34.
    pub hisparse_import_step_tokens: Option<usize>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The least common multiple of the group block sizes (vLLM's default scheduler block size).
pub fn lcm_of(sizes: impl IntoIterator<Item = usize>) -> usize {
    sizes.into_iter().fold(1, |acc, b| if b == 0 { acc } else { acc / gcd(acc, b) * b })
}

impl GroupSpec {
    /// Check the group's own parameters.
    pub fn validate(&self, i: usize) -> Result<()> {
        let arg = format!("kv_cache_groups[{i}]");
        if self.block_size == 0 {
            return Err(Error::value(&arg, "block_size must be > 0"));
        }
        match self.kind {
            Kind::SlidingWindow { window: 0, .. } => Err(Error::value(&arg, "sliding_window must be > 0")),
            Kind::ChunkedLocal { chunk: 0 } => Err(Error::value(&arg, "attention_chunk_size must be > 0")),
            Kind::Mamba { prefill_checkpoint_alignment: Some(0), .. } => {
                Err(Error::value(&arg, "prefill_checkpoint_alignment must be > 0"))
            }
            Kind::HiSparseHot { blocks_per_request: 0 } => Err(Error::value(&arg, "blocks_per_request must be > 0")),
            _ => Ok(()),
        }
    }

    /// vLLM's `max_admission_blocks_per_request` (sliding window, chunked local and
    /// HiSparse resident groups only).
    pub fn max_admission_blocks(&self, max_in_flight_tokens: usize, max_model_len: usize) -> Option<usize> {
        match self.kind {
            Kind::SlidingWindow { window, extra_retained_tokens } => {
                let n = (window - 1 + extra_retained_tokens).saturating_add(max_in_flight_tokens).min(max_model_len);
                Some(n.div_ceil(self.block_size) + 1)
            }
            Kind::ChunkedLocal { chunk } => {
                let n = chunk.saturating_add(max_in_flight_tokens).min(max_model_len);
                Some(n.div_ceil(self.block_size))
            }
            Kind::HiSparseResident => Some(max_in_flight_tokens.min(max_model_len).div_ceil(self.block_size)),
            _ => None,
        }
    }
}

/// The two dialects a manager is called in. The core is the same; what differs is how
/// arguments are read and how errors are raised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// kvblock's own API (`kvblock.KVCacheManager`): a request longer than `max_model_len`
    /// and hit blocks that do not cover `num_new_computed_tokens` are refused with a
    /// `ValueError` (vLLM's engine never makes such calls, and vLLM's manager does not check
    /// them); configuration errors are `ValueError`s naming the argument.
    Kvblock,
    /// vLLM's callers (`kvblock.vllm.KVCacheManager`): errors are raised as vLLM's own (an
    /// `AssertionError` where vLLM asserts, an `IndexError` past a request's hashes, an
    /// `AttributeError` for a missing request attribute) and arguments are read as vLLM's
    /// method bodies read them.
    Vllm,
}

impl Caller {
    /// True for kvblock's own API.
    #[inline(always)]
    pub fn is_kvblock(self) -> bool {
        self == Caller::Kvblock
    }
}

impl ManagerConfig {
    /// A configuration of `groups` over `num_blocks` blocks with prefix caching on, one block
    /// size (`block_size`, the scheduler's and the hash's), at most `max_model_len` tokens a
    /// request (and in flight a step), and every other option off: no EAGLE, lookahead,
    /// context parallelism, watermark, events, zeroing, retention, Mamba checkpoint or
    /// HiSparse host pool; 0.33's rules. Set the rest with struct update syntax.
    pub fn new(
        groups: Vec<GroupSpec>,
        num_blocks: usize,
        max_model_len: usize,
        block_size: usize,
        caller: Caller,
    ) -> Self {
        ManagerConfig {
            groups,
            num_blocks,
            max_model_len,
            max_in_flight_tokens: max_model_len,
            scheduler_block_size: block_size,
            hash_block_size: block_size,
            enable_caching: true,
            use_eagle: false,
            num_hash_lookahead_tokens: 0,
            num_prefill_lookahead: 0,
            dcp_world_size: 1,
            pcp_world_size: 1,
            watermark_blocks: 0,
            enable_kv_cache_events: false,
            needs_kv_cache_zeroing: false,
            retention_interval: None,
            enable_mamba_shared_prefix_checkpoint: false,
            caller,
            rules: ReleaseRules::default(),
            hisparse_host_num_blocks: None,
            hisparse_import_step_tokens: None,
        }
    }

    /// An error for a configuration vLLM's constructors refuse with an `assert`: an
    /// `AssertionError` as vLLM's for [`Caller::Vllm`], a `ValueError`
    /// naming the argument for [`Caller::Kvblock`].
    pub fn asserted(&self, arg: &str, msg: impl Into<String>) -> Error {
        if self.caller.is_kvblock() {
            Error::value(arg, msg.into())
        } else {
            Error::Assertion(format!("{arg}: {}", msg.into()))
        }
    }

    /// An error for a configuration vLLM's constructors refuse with a `ValueError` of their
    /// own: `Error::Value` with vLLM's message as it stands for [`Caller::Vllm`], with the
    /// argument named first for [`Caller::Kvblock`].
    pub fn refused(&self, arg: &str, msg: impl Into<String>) -> Error {
        if self.caller.is_kvblock() {
            Error::value(arg, msg.into())
        } else {
            Error::Value(msg.into())
        }
    }

    /// Check the configuration as vLLM's coordinator constructors do: their `ValueError`s
    /// as [`ManagerConfig::refused`] errors, everything else kvblock refuses as
    /// [`ManagerConfig::asserted`] errors (a `ValueError` naming the argument for kvblock's
    /// API, an `AssertionError` for vLLM's callers), so the binding maps error kinds, never
    /// message text.
    pub fn validate(&self) -> Result<()> {
        if self.num_blocks == 0 {
            return Err(self.asserted("num_blocks", "must be > 0 (block 0 is the null block)"));
        }
        if self.max_model_len == 0 {
            return Err(self.asserted("max_model_len", "must be > 0"));
        }
        if self.hash_block_size == 0 {
            return Err(self.asserted("hash_block_size", "must be > 0"));
        }
        if self.scheduler_block_size == 0 {
            return Err(self.asserted("scheduler_block_size", "must be > 0"));
        }
        if self.dcp_world_size == 0 || self.pcp_world_size == 0 {
            return Err(self.asserted("dcp_world_size", "world sizes must be >= 1"));
        }
        for (i, g) in self.groups.iter().enumerate() {
            g.validate(i).map_err(|e| self.reassert(e))?;
        }
        if self.hisparse_host_num_blocks == Some(0) {
            return Err(Error::value("hisparse_host_num_blocks", "must be > 0 (block 0 is the null block)"));
        }
        if !self.scheduler_block_size.is_multiple_of(self.hash_block_size) {
            return Err(self.asserted(
                "scheduler_block_size",
                format!("{} is not a multiple of hash_block_size {}", self.scheduler_block_size, self.hash_block_size),
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if !self.scheduler_block_size.is_multiple_of(g.block_size) {
                return Err(self.asserted(
                    "scheduler_block_size",
                    format!(
                        "{} is not a multiple of kv_cache_groups[{i}]'s block size {}",
                        self.scheduler_block_size, g.block_size
                    ),
                ));
            }
        }
        // vLLM's order: the coordinator's MTP check, the per-type managers' own checks,
        // the retention interval, then the unitary / hybrid coordinator's checks
        if self.enable_caching
            && (self.groups.iter().any(|g| g.is_eagle_group) || self.use_eagle)
            && self.scheduler_block_size < self.num_prefill_lookahead
        {
            return Err(self.refused(
                "num_prefill_lookahead",
                format!(
                    "Multi-module MTP with prefix caching requires scheduler_block_size (={}) >= num_speculative_tokens (={})",
                    self.scheduler_block_size, self.num_prefill_lookahead
                ),
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if let Kind::Mamba { mode: MambaMode::None, .. } = g.kind {
                if self.enable_caching && !self.rules.mamba_none_mode_caches {
                    return Err(self.asserted(
                        &format!("kv_cache_groups[{i}]"),
                        "Mamba prefix caching requires mamba_cache_mode='align'",
                    ));
                }
            }
        }
        if let Some(r) = self.retention_interval {
            let sparse = self.groups.iter().any(|g| matches!(g.kind, Kind::SlidingWindow { .. } | Kind::Mamba { .. }));
            if !sparse && r != 0 {
                return Err(self.refused(
                    "prefix_cache_retention_interval",
                    "is set but this model has no sliding-window or Mamba KV cache group, so retention has no effect",
                ));
            }
            if sparse && r % self.scheduler_block_size != 0 {
                return Err(self.refused(
                    "prefix_cache_retention_interval",
                    format!(
                        "({r}) must be non-negative and a multiple of scheduler_block_size ({})",
                        self.scheduler_block_size
                    ),
                ));
            }
        }
        if self.enable_caching && self.groups.len() == 1 {
            let bs = self.groups[0].block_size * self.dcp_of(&self.groups[0]);
            if self.hash_block_size != bs {
                return Err(self.asserted(
                    "hash_block_size",
                    format!("one KV-cache group hashes at its block size ({bs}), got {}", self.hash_block_size),
                ));
            }
        }
        if self.enable_caching && self.groups.len() > 1 {
            for (i, g) in self.groups.iter().enumerate() {
                let bs = g.block_size * self.dcp_of(g);
                if g.prefix_cacheable && !bs.is_multiple_of(self.hash_block_size) {
                    return Err(self.asserted(
                        "hash_block_size",
                        format!("{} does not divide kv_cache_groups[{i}]'s block size {bs}", self.hash_block_size),
                    ));
                }
            }
            if !self.groups.iter().any(|g| g.prefix_cacheable) {
                return Err(
                    self.asserted("kv_cache_groups", "a hybrid model needs at least one prefix-cacheable group")
                );
            }
        }
        Ok(())
    }

    /// A `ValueError`-kind error of a group's own check, as [`ManagerConfig::asserted`] would
    /// raise it (the message already names the group).
    fn reassert(&self, e: Error) -> Error {
        match e {
            Error::Value(m) if !self.caller.is_kvblock() => Error::Assertion(m),
            e => e,
        }
    }

    /// The DCP factor of a group's block size.
    pub fn dcp_of(&self, g: &GroupSpec) -> usize {
        if g.dcp_sharded {
            self.dcp_world_size
        } else {
            1
        }
    }
}
