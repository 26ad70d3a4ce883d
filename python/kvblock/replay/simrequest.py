"""The request object the simulator hands to the KV cache manager.

It carries exactly the attributes vLLM 0.33.0's ``KVCacheManager`` reads from a
``vllm.v1.request.Request`` (``request_id``, ``num_tokens``, ``num_computed_tokens``,
``block_hashes``, ``status``, ``num_preemptions``, ``skip_reading_prefix_cache``,
``kv_cache_report_mode``, ``num_in_flight_tokens``) without materialising token lists: a
replayed prompt can be 100k tokens long and only its block hashes matter to the manager.
"""

from __future__ import annotations

from ..request import RequestStatus
from .trace import TraceRequest

__all__ = ["SimRequest"]


class SimRequest:
    """A replayed request: vLLM's manager-facing fields plus the simulator's bookkeeping.

    Attributes:
        spec: the :class:`TraceRequest`; output_len: outputs to sample (its ``output_len``).
        num_output_tokens: outputs sampled so far.
        tail: prompt tokens after the last full block followed by every output token
            (built on the first output block to hash), or None.
        hit_blocks: prefix-hit blocks adopted at the latest admission.
        cached_blocks: blocks the manager has cached for the request since that admission
            (``min(computed, num_tokens, len(block_hashes) * B) // B``, spec §5.3 step 12),
            hit blocks included.
        table_blocks: blocks in the request's block table since that admission.
        hashed: whether ``block_hashes`` holds the prompt's digests yet.
    """

    __slots__ = (
        "request_id", "num_tokens", "num_computed_tokens", "block_hashes", "status",
        "num_preemptions", "skip_reading_prefix_cache", "kv_cache_report_mode",
        "num_in_flight_tokens", "spec", "output_len", "num_output_tokens", "tail", "hit_blocks",
        "cached_blocks", "table_blocks", "hashed", "retention", "retention_priority",
    )

    def __init__(self, spec: TraceRequest) -> None:
        self.spec = spec
        self.request_id = spec.request_id
        self.num_tokens = spec.prompt_len
        self.num_computed_tokens = 0
        self.block_hashes: list = []
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.skip_reading_prefix_cache = False
        self.kv_cache_report_mode = "incremental"
        self.num_in_flight_tokens = 0
        self.output_len = spec.output_len
        self.num_output_tokens = 0
        self.tail = None
        self.hit_blocks = 0
        self.cached_blocks = 0
        self.table_blocks = 0
        self.hashed = False
        self.retention = None
        self.retention_priority = None

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )
