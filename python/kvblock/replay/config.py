"""Settings of a replay: :class:`SimConfig`."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from ..hashing import ALGORITHMS
from .backends import IMPLS
from .errors import ReplayError, SettingError
from .trace import MAX_ARRIVAL_MS, SchedulerDefaults, Trace

__all__ = ["DEFAULTS", "MAX_SIMULATED_MS", "SimConfig", "check_time_span"]


#: The longest simulated time: a scheduler step (``step_ms``), the scale of arrival times
#: (``time_scale``, the trace time a 1 ms trace becomes) and a trace's arrivals once scaled
#: (:func:`check_time_span`) must stay within the 366 days a trace's own timestamps may span
#: (:data:`~kvblock.replay.trace.MAX_ARRIVAL_MS`): past it a simulated clock in ms is no
#: longer a schedule (``time_scale=1e290`` printed a 300-digit step count).
MAX_SIMULATED_MS = MAX_ARRIVAL_MS


#: The most blocks a pool can have: block ids are int32, as in vLLM.
MAX_NUM_BLOCKS = 2**31 - 1

#: Host memory a simulated engine takes per block of its pool (the block arena, the free
#: queue and the hash tables: 47-50 bytes measured on fleets of 500 engines at 1k-64k
#: blocks each), and per engine besides (its manager, router and report state).
ENGINE_BYTES_PER_BLOCK = 48
ENGINE_BYTES = 64 * 1024


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``), or None
    where that cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_time_span(trace: Trace, cfg: SimConfig) -> None:
    """Refuse a ``time_scale`` that puts the trace's last arrival past
    :data:`MAX_SIMULATED_MS` (366 days) on the simulated clock (not checked with ``asap``,
    which ignores arrival times).

    Raises:
        SettingError: naming ``time_scale`` (the ``kvblock`` command: ``--time-scale``).
    """
    if cfg.asap or not trace.requests:
        return
    last = max(r.arrival_ms for r in trace.requests)
    if last * cfg.time_scale > MAX_SIMULATED_MS:
        raise SettingError(
            "time_scale",
            f"{{name}} {cfg.time_scale:g} puts the trace's last arrival ({last:g} ms) past 366 days on the "
            f"simulated clock; use at most {MAX_SIMULATED_MS / last:g}",
        )


def check_engine_memory(instances: int, num_blocks: int | None) -> None:
    """Refuse, before anything is built, a replay whose ``instances`` engine pools of
    ``num_blocks`` blocks each would not fit in the memory available (the kernel would
    kill the process part way). Unlimited pools (None) grow as used and are not checked.

    Raises:
        ReplayError: the estimate (:data:`ENGINE_BYTES_PER_BLOCK` a block plus
            :data:`ENGINE_BYTES` an engine) is over :func:`available_memory`.
    """
    if num_blocks is None:
        return
    need = instances * (num_blocks * ENGINE_BYTES_PER_BLOCK + ENGINE_BYTES)
    avail = available_memory()
    if avail is not None and need > avail:
        gib = 2**30
        raise ReplayError(
            f"{instances:,} engine(s) of {num_blocks:,} blocks need about {need / gib:,.1f} GiB for their block "
            f"pools (about {ENGINE_BYTES_PER_BLOCK} bytes a block), more than the {avail / gib:,.1f} GiB available: "
            f"use fewer --instances or fewer --num-blocks")

def _int_field(name: str, value: Any, none_ok: bool = False) -> None:
    """A ``SimConfig`` int field: an int (not a bool), or None where that means unlimited."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy ints too
        what = "an int or None" if none_ok else "an int"
        raise SettingError(name, f"{{name}} must be {what}, got {type(value).__name__}")


@dataclass(frozen=True)
class SimConfig:
    """How to replay a workload.

    Attributes:
        num_blocks: KV-cache blocks including vLLM's null block 0 (``num_gpu_blocks``);
            None means unlimited: enough blocks that nothing is ever evicted.
        block_size: tokens per block (also the hash block size).
        hash_algo: ``sha256`` (vLLM's default), ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``.
        impl: ``"kvblock"`` or ``"reference"``.
        ideal: requests finish instantly (admit, record, free, one at a time in arrival
            order): the replay measures the prefix cache alone.
        max_running: most requests running at once (vLLM ``max_num_seqs``).
        token_budget: tokens scheduled per step (``max_num_batched_tokens``); None: unlimited.
        chunked_prefill: split prompts longer than the remaining budget across steps.
        asap: ignore timestamps: every request is waiting from the start.
        step_ms: simulated duration of one scheduler step (milliseconds).
        time_scale: multiply arrival timestamps by this (0.5 = twice the request rate).
        fingerprint: compute the block-id fingerprint of the workload README §5.1.
        retention: eviction policy, one of :data:`kvblock.replay.retention.POLICIES`
            (``lru``: vLLM's); ttl_s: the ``ttl`` policy's seconds; pin_tokens: tokens the
            ``pin-system-prompts`` policy pins (None: 2048).
    """

    num_blocks: int | None = 32768
    block_size: int = 16
    hash_algo: str = "sha256"
    impl: str = "kvblock"
    ideal: bool = False
    max_running: int = 256
    token_budget: int | None = 8192
    chunked_prefill: bool = True
    asap: bool = False
    step_ms: float = 20.0
    time_scale: float = 1.0
    fingerprint: bool = False
    retention: str = "lru"
    ttl_s: float = 300.0
    pin_tokens: int | None = None

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        """Check every field (see :meth:`validate`)."""
        _int_field("num_blocks", self.num_blocks, none_ok=True)
        _int_field("block_size", self.block_size)
        _int_field("max_running", self.max_running)
        _int_field("token_budget", self.token_budget, none_ok=True)
        _int_field("pin_tokens", self.pin_tokens, none_ok=True)
        for name in ("step_ms", "time_scale", "ttl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise SettingError(name, f"{{name}} must be a number, got {type(value).__name__}")
        for name in ("ideal", "chunked_prefill", "asap", "fingerprint"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise SettingError(name, f"{{name}} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("hash_algo", "impl", "retention"):
            if not isinstance(getattr(self, name), str):
                raise SettingError(name, f"{{name}} must be a str, got {type(getattr(self, name)).__name__}")
        if self.block_size <= 0:
            raise SettingError("block_size", f"{{name}} must be > 0, got {self.block_size}")
        if self.block_size > MAX_NUM_BLOCKS:
            raise SettingError("block_size", f"{{name}} must be <= {MAX_NUM_BLOCKS:,} tokens, got {self.block_size:,}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise SettingError(
                "num_blocks", f"{{name}} must be >= 2 (block 0 is vLLM's null block), got {self.num_blocks}"
            )
        if self.num_blocks is not None and self.num_blocks > MAX_NUM_BLOCKS:
            raise SettingError(
                "num_blocks", f"{{name}} must be <= {MAX_NUM_BLOCKS:,} (int32 block ids), got {self.num_blocks:,}"
            )
        if self.hash_algo not in ALGORITHMS:
            raise SettingError("hash_algo", f"unknown {{name}} {self.hash_algo!r}; choose from {', '.join(ALGORITHMS)}")
        if self.impl not in IMPLS:
            raise SettingError("impl", f"unknown {{name}} {self.impl!r}; choose from {', '.join(IMPLS)}")
        if self.max_running < 1:
            raise SettingError("max_running", f"{{name}} must be >= 1, got {self.max_running}")
        if self.token_budget is not None and self.token_budget < 1:
            raise SettingError(
                "token_budget", f"{{name}} must be >= 1 (or 0 for unlimited), got {self.token_budget}"
            )
        if not (self.step_ms > 0 and math.isfinite(self.step_ms)):
            raise SettingError("step_ms", f"{{name}} must be a finite number > 0, got {self.step_ms}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise SettingError("time_scale", f"{{name}} must be a finite number > 0, got {self.time_scale}")
        if self.step_ms > MAX_SIMULATED_MS:
            raise SettingError(
                "step_ms", f"{{name}} must be <= {MAX_SIMULATED_MS:,} (366 days), got {self.step_ms:g}"
            )
        if self.time_scale > MAX_SIMULATED_MS:
            raise SettingError(
                "time_scale",
                f"{{name}} must be <= {MAX_SIMULATED_MS:,} (a 1 ms trace scaled past 366 days), got {self.time_scale:g}",
            )
        from .retention import RetentionPolicy

        RetentionPolicy(self.retention, self.block_size, self.pin_tokens, self.ttl_s)  # checks them

    def validate(self) -> "SimConfig":
        """Return self: every field is checked when the config is built (also by
        :func:`dataclasses.replace`), so a ``SimConfig`` that exists is valid.

        Raises (when built):
            SettingError: a field of the wrong type, a non-positive size, budget, step or
                scale, fewer than 2 blocks (the null block plus one), an unknown hash
                algorithm or implementation, an unknown retention policy, a non-positive
                ``ttl_s`` or ``pin_tokens``; the message names the field.
        """
        self._check()
        return self

    def with_defaults(self, defaults: SchedulerDefaults, explicit: set[str]) -> "SimConfig":
        """Apply a workload's defaults to the fields not in ``explicit``."""
        changes: dict[str, Any] = {}
        for name, value in asdict(defaults).items():
            if value is None or name in explicit:
                continue
            if name == "token_budget":
                value = value or None
            changes[name] = value
        return replace(self, **changes)

    def resolved_num_blocks(self, trace: Trace) -> int:
        """``num_blocks``, or for unlimited the blocks every request could ever hold at once
        plus the null block (so no block is ever evicted)."""
        if self.num_blocks is not None:
            return self.num_blocks
        b = self.block_size
        if self.ideal:
            total = sum(-(-r.prompt_len // b) for r in trace.requests)
        else:
            total = sum(-(-(r.prompt_len + max(r.output_len, 1) - 1) // b) for r in trace.requests)
        return total + 1

    def describe(self, trace: Trace) -> dict[str, Any]:
        """The settings as a plain dict (unlimited blocks resolved, ``num_blocks_unlimited``
        telling which)."""
        d = asdict(self)
        d["num_blocks"] = self.resolved_num_blocks(trace)
        d["num_blocks_unlimited"] = self.num_blocks is None
        if self.ideal:
            for k in ("max_running", "token_budget", "chunked_prefill", "asap", "step_ms", "time_scale"):
                d.pop(k)
        if self.retention == "lru":
            for k in ("retention", "ttl_s", "pin_tokens"):
                d.pop(k)
        return d


#: The general defaults.
DEFAULTS = SimConfig()
