"""Retention policies for replays (``kvblock replay --retention POLICY``).

* ``lru``: vLLM 0.33.0's eviction (the default; the manager is built exactly as before).
* ``priority``: priority retention, fed online by what the replay has seen: the leading
  blocks of a prompt that an earlier prompt also began with (a shared prefix) get priority
  80 for good, the rest the default 35, so one-off prompts are evicted before shared
  prefixes.
* ``pin-system-prompts``: each prompt whose leading blocks were a cache hit pins the first
  ``pin_tokens`` of them (the system prompt; default the workload's, else 2048 tokens), up
  to a quarter of the pool; pins over the cap are skipped. Pins give way when they would
  starve the pool: a request that fits the pool but cannot be allocated with nothing else
  running releases the oldest pins, one at a time, until it fits (counted in
  ``pins_released``), so an idle pool serves any servable request.
* ``ttl``: priority 80 for the whole prompt, decaying to 35 ``ttl_s`` seconds (default 300,
  Anthropic's 5-minute cache) after release on the replay's simulated clock.

Both implementations (kvblock and the reference) take the same manager arguments, so
``--compare`` holds with any policy.
"""

from __future__ import annotations

from typing import Any

from .errors import SettingError

__all__ = ["POLICIES", "RetentionPolicy", "SimClock"]

#: The policy names.
POLICIES = ("lru", "priority", "pin-system-prompts", "ttl")
SHARED_PRIORITY = 80
DEFAULT_PIN_TOKENS = 2048
PIN_FRACTION = 0.25


class SimClock:
    """The replay's simulated clock in seconds (set by the simulator)."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class RetentionPolicy:
    """One replay's policy state.

    Args:
        name: one of :data:`POLICIES`.
        block_size: tokens per block.
        pin_tokens: tokens ``pin-system-prompts`` pins (None: 2048).
        ttl_s: the ``ttl`` policy's seconds.

    Raises:
        SettingError: an unknown policy, a non-positive ``ttl_s`` (or one past 366 days) or ``pin_tokens`` (a
            :class:`ReplayError` naming the field, or its option on the command line).
    """

    def __init__(self, name: str, block_size: int, pin_tokens: int | None = None, ttl_s: float = 300.0) -> None:
        # SettingError: the field's name in Python, the option's on the command line
        if name not in POLICIES:
            raise SettingError("retention", f"unknown {{name}} {name!r}; choose from {', '.join(POLICIES)}")
        if not ttl_s > 0:
            raise SettingError("ttl_s", f"{{name}} must be > 0, got {ttl_s}")
        if not ttl_s <= 366 * 86_400:  # inf, or past the 366 days a trace's timestamps may span
            raise SettingError("ttl_s", f"{{name}} must be at most 366 days (31,622,400 s), got {ttl_s:g}")
        if pin_tokens is not None and pin_tokens < block_size:
            raise SettingError("pin_tokens", f"{{name}} must be at least one block ({block_size}), got {pin_tokens}")
        self.name = name
        self.block_size = block_size
        self.pin_blocks = (DEFAULT_PIN_TOKENS if pin_tokens is None else pin_tokens) // block_size
        self.ttl_s = ttl_s
        self.clock = SimClock()
        self.seen: set[bytes] = set()
        #: the pins held, oldest first: last block hash -> the pinned prefix's hashes
        self.pinned: dict[bytes, list[bytes]] = {}
        self.pins = 0
        self.pins_released = 0

    def manager_kwargs(self) -> dict[str, Any]:
        """Extra manager arguments ({} for ``lru``: vLLM's manager exactly)."""
        if self.name == "lru":
            return {}
        if self.name == "pin-system-prompts":
            return {"max_pinned_fraction": PIN_FRACTION, "clock": self.clock}
        return {"priority_retention": True, "clock": self.clock}

    def before_admit(self, req: Any, now_s: float) -> None:
        """Set the clock and the request's retention before its first admission."""
        self.clock.t = now_s
        if self.name == "priority":
            hashes = req.block_hashes
            k = 0
            while k < len(hashes) and hashes[k] in self.seen:
                k += 1
            self.seen.update(hashes)
            req.retention = [(0, k * self.block_size, SHARED_PRIORITY, None)] if k else None
        elif self.name == "ttl" and req.num_tokens > 0:
            req.retention = [(0, req.num_tokens, SHARED_PRIORITY, self.ttl_s)]

    def after_admit(self, mgr: Any, req: Any, num_hit_tokens: int) -> None:
        """``pin-system-prompts``: pin the leading hit blocks (once per prefix)."""
        if self.name != "pin-system-prompts":
            return
        k = min(num_hit_tokens // self.block_size, self.pin_blocks)
        if k == 0:
            return
        prefix = list(req.block_hashes[:k])
        if prefix[-1] in self.pinned:
            return
        try:
            mgr.pin_prefix(prefix)
        except ValueError:
            return  # over the cap: not pinned
        self.pinned[prefix[-1]] = prefix
        self.pins += 1

    def give_way(self, mgr: Any) -> bool:
        """Release the oldest pin so that a starved request can be allocated; False when no
        pin is held (nothing can give way)."""
        while self.pinned:
            key = next(iter(self.pinned))
            prefix = self.pinned.pop(key)
            try:
                mgr.unpin_prefix(prefix)
            except ValueError:
                continue  # no longer pinned (its TTL ran out)
            self.pins_released += 1
            return True
        return False
