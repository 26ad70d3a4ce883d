""":class:`Router`: send each request to an engine instance, by policy.

Policies:

* ``round-robin`` — instances in turn;
* ``least-loaded`` — the smallest load, ``running_tokens + waiting_tokens`` (ties in turn);
* ``cache-aware`` — the largest score ``cached_tokens - load_weight * load``, where
  ``cached_tokens`` is the instance's longest cached prefix of the request in tokens (from
  the prefix index: exact vLLM block hashes, only blocks the instance holds) and ``load`` as
  above. It is the cost "prefill tokens still to compute + weighted queue" of Dynamo's KV
  router and llm-d's weighted prefix / load scorers, as one number (a request's own prompt
  length is the same on every instance, so it drops out). ``load_weight = 0`` routes on the
  cache alone (ties by load), large weights approach least-loaded.

Tier weights (``tier_weights={"GPU": 1.0, "CPU": 0.75, "disk": 0.25}``, the media of vLLM's
KV events): a block on host memory or disk saves less than one on the GPU (it must be loaded
back first), so ``cached_tokens`` becomes the instance's tier-weighted prefix
(``PrefixIndex.match_weighted``: the prefix on the best tier at its weight, what the next
tier extends it by at the next weight, ...; a medium not named weighs 0). Dynamo's KV router
credits 0.75 / 0.25 for host / disk. The decision's ``cached_blocks`` is then the prefix over
every positively weighted medium.

With a :class:`~kvblock.cluster.speculative.SpeculativeIndex` as the index, ``cache-aware``
scores each instance with its speculative prefix (blocks it holds, then blocks it was just
sent and will compute) and records the chosen instance's speculative entries; the decision's
``cached_blocks`` stays the exact count.

While the index cannot answer (:class:`~kvblock.cluster.errors.IndexUnavailable`, e.g. Redis
down) ``cache-aware`` routes by load alone, logs one warning per outage and tries the index
again on every request, so it resumes as soon as the index is back.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .errors import IndexUnavailable

__all__ = ["POLICIES", "Decision", "Router"]

log = logging.getLogger("kvblock.cluster")

#: The routing policies.
POLICIES = ("round-robin", "least-loaded", "cache-aware")


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why.

    Attributes:
        instance: the chosen instance.
        policy: the policy that decided (``"least-loaded"`` when cache-aware fell back).
        cached_blocks: the chosen instance's cached prefix of the request, in blocks (0 when
            the index was not asked or not available).
        cached_tokens: the same in tokens (at most the request's length).
        index_available: False when cache-aware routing fell back to load alone.
        speculative_blocks: with a speculative index, the chosen instance's prefix counting
            speculative entries too (>= ``cached_blocks``); else ``cached_blocks``.
    """

    instance: str
    policy: str
    cached_blocks: int = 0
    cached_tokens: int = 0
    index_available: bool = True
    speculative_blocks: int = 0


class Router:
    """Routes requests over ``instances`` (see the module docstring).

    Args:
        instances: the engine instance names (their order is the round-robin order).
        index: a prefix index with ``match(block_hashes) -> {instance: blocks}`` (needed for
            ``cache-aware``): ``PrefixIndex``, ``DictIndex`` or ``RedisPrefixIndex``.
        policy: one of :data:`POLICIES`.
        block_size: tokens per block of the index's hashes.
        load_weight: the weight of a token of load against a cached token (cache-aware).
        medium: count only blocks on this medium (None: any).
        tier_weights: each medium's weight in the cache-aware score (see the module
            docstring; None: every medium counts fully). Needs an index with
            ``match_weighted`` (``PrefixIndex``, ``DictIndex``).

    Raises:
        TypeError: ``instances`` a single string rather than an iterable of names, a name
            that is not a ``str``, a ``load_weight`` that is not a number.
        ValueError: an unknown policy, no instances, an empty or duplicate name, a
            ``load_weight`` that is negative or not finite, ``cache-aware`` without an index, tier weights that are not finite numbers >= 0
            or not keyed by medium names, tier weights with ``medium``, with a speculative
            index or an index without ``match_weighted``.
    """

    def __init__(self, instances: Iterable[str], index: Any = None, policy: str = "cache-aware", *,
                 block_size: int = 16, load_weight: float = 0.5, medium: str | None = None,
                 tier_weights: Mapping[str | None, float] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(POLICIES)}")
        if isinstance(instances, (str, bytes)):
            raise TypeError(f"instances: expected an iterable of instance names, got one {type(instances).__name__} "
                            f"({instances!r}); write [{instances!r}]")
        names = [_instance_name(n) for n in instances]
        if not names:
            raise ValueError("a router needs at least one instance")
        if len(set(names)) != len(names):
            raise ValueError("instance names must be unique")
        if policy == "cache-aware" and index is None:
            raise ValueError("the cache-aware policy needs an index")
        if isinstance(load_weight, bool) or not isinstance(load_weight, (int, float)):
            raise TypeError(f"load_weight: expected a number, got {type(load_weight).__name__}")
        if not 0 <= load_weight < math.inf:
            # inf * an idle instance's load 0 is nan, which no score compares above
            raise ValueError(f"load_weight must be a finite number >= 0, got {load_weight}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
        indexed = getattr(index, "block_size", None)
        if isinstance(indexed, int) and indexed != block_size:
            # a hit of N blocks is N * block_size tokens: with the index's blocks of another
            # size every claim would be off by their ratio
            raise ValueError(f"block_size {block_size} differs from the index's block_size {indexed}")
        self.tier_weights = _check_tier_weights(tier_weights, index, medium)
        self.instances = names
        self.index = index
        self.policy = policy
        self.block_size = block_size
        self.load_weight = float(load_weight)
        self.medium = medium
        self._pos = {n: i for i, n in enumerate(names)}
        self._running = {n: 0 for n in names}
        self._waiting = {n: 0 for n in names}
        self._next = 0
        self.index_available = True
        self.fallbacks = 0

    # -- fleet state --------------------------------------------------------------------------
    def set_load(self, instance: str, running_tokens: int, waiting_tokens: int) -> None:
        """The instance's load now: tokens of its running requests and of its waiting ones.

        Raises:
            KeyError: an unknown instance.
            ValueError: a negative token count (nothing is changed).
        """
        if instance not in self._pos:
            raise KeyError(f"unknown instance {instance!r}")
        running, waiting = _tokens("running_tokens", running_tokens), _tokens("waiting_tokens", waiting_tokens)
        self._running[instance] = running
        self._waiting[instance] = waiting

    def add_waiting(self, instance: str, tokens: int) -> None:
        """A request of ``tokens`` prompt tokens was just sent to ``instance`` (counted as
        waiting until the next :meth:`set_load`).

        Raises:
            KeyError: an unknown instance.
            ValueError: a negative token count (nothing is changed).
        """
        if instance not in self._pos:
            raise KeyError(f"unknown instance {instance!r}")
        self._waiting[instance] += _tokens("tokens", tokens)

    def load(self, instance: str) -> int:
        """The instance's load in tokens: running plus waiting (see :meth:`set_load`).

        Raises:
            KeyError: an unknown instance.
        """
        if instance not in self._pos:
            raise KeyError(f"unknown instance {instance!r}")
        return self._running[instance] + self._waiting[instance]

    def add_instance(self, instance: str) -> None:
        """Route to ``instance`` too (last in the round-robin order, with no load); a name
        already routed to is left as it is.

        Raises:
            TypeError / ValueError: a name that is not a non-empty ``str``.
        """
        instance = _instance_name(instance)
        if instance in self._pos:
            return
        self._pos[instance] = len(self.instances)
        self.instances.append(instance)
        self._running[instance] = self._waiting[instance] = 0

    def remove_instance(self, instance: str) -> None:
        """Stop routing to ``instance`` (KeyError if unknown; the last one cannot go)."""
        if instance not in self._pos:
            raise KeyError(f"unknown instance {instance!r}")
        if len(self.instances) == 1:
            raise ValueError("cannot remove the last instance")
        self.instances.remove(instance)
        self._pos = {n: i for i, n in enumerate(self.instances)}
        del self._running[instance], self._waiting[instance]

    # -- routing ------------------------------------------------------------------------------
    def _turn(self) -> str:
        name = self.instances[self._next % len(self.instances)]
        self._next = (self._next + 1) % len(self.instances)
        return name

    def _least_loaded(self) -> str:
        n = len(self.instances)
        start = self._next
        best, best_load = None, None
        for k in range(n):
            name = self.instances[(start + k) % n]
            ld = self._running[name] + self._waiting[name]
            if best_load is None or ld < best_load:
                best, best_load = name, ld
        assert best is not None  # there is always an instance
        self._next = (self._pos[best] + 1) % n
        return best

    def route(self, block_hashes: Sequence[Any], num_tokens: int) -> Decision:
        """Choose the instance for a request of ``num_tokens`` prompt tokens whose full blocks
        hash to ``block_hashes`` (vLLM's ``request.block_hashes``, bytes or event ints).

        Raises:
            ValueError / TypeError: malformed block hashes (from the index), or a negative
                ``num_tokens``.
        """
        num_tokens = _tokens("num_tokens", num_tokens)
        if self.policy == "round-robin":
            return Decision(self._turn(), "round-robin")
        if self.policy == "least-loaded":
            return Decision(self._least_loaded(), "least-loaded")
        speculative = getattr(self.index, "speculative", False)
        try:
            kw = {"instances": self.instances} if getattr(self.index, "wants_instances", False) else {}
            if not len(block_hashes):
                hits: dict[str, int] = {}
                scored = hits
            elif speculative:
                hits, scored = self.index.match_both(block_hashes, self.medium, **kw)
            elif self.tier_weights is not None:
                weighted = self.index.match_weighted(block_hashes, self.tier_weights)
                hits = {k: v[1] for k, v in weighted.items()}
                scored = {k: v[0] for k, v in weighted.items()}
            else:
                hits = self.index.match(block_hashes, self.medium, **kw)
                scored = hits
        except IndexUnavailable as e:
            self.fallbacks += 1
            if self.index_available:
                log.warning("kvblock.cluster: the prefix index is unavailable (%s); routing by load "
                            "until it is back", e)
                self.index_available = False
            return Decision(self._least_loaded(), "least-loaded", index_available=False)
        if not self.index_available:
            log.warning("kvblock.cluster: the prefix index is available again; cache-aware routing resumes")
            self.index_available = True
        b, w = self.block_size, self.load_weight
        n = len(self.instances)
        start = self._next
        best = None
        best_key = None
        for k in range(n):
            name = self.instances[(start + k) % n]
            cached = min(scored.get(name, 0) * b, num_tokens)  # weighted: a float
            ld = self._running[name] + self._waiting[name]
            key = (cached - w * ld, -ld)
            if best_key is None or key > best_key:
                best, best_key = name, key
        assert best is not None
        self._next = (self._pos[best] + 1) % n
        blocks = hits.get(best, 0)
        if speculative and len(block_hashes):
            self.index.speculate(best, block_hashes, blocks)
        # tier weights score a weighted prefix; the decision reports blocks
        return Decision(best, "cache-aware", blocks, min(blocks * b, num_tokens),
                        speculative_blocks=scored.get(best, 0) if speculative else blocks)


def _instance_name(name: Any) -> str:
    """An instance name: a non-empty ``str`` (TypeError / ValueError otherwise)."""
    if not isinstance(name, str):
        raise TypeError(f"an instance name must be a str, got {type(name).__name__} ({name!r})")
    if not name:
        raise ValueError("an instance name must not be empty")
    return name


def _tokens(name: str, value: Any) -> int:
    """A token count: an int >= 0, or ValueError / TypeError naming it."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")
    return value


def _check_tier_weights(weights: Mapping[str | None, float] | None, index: Any,
                        medium: str | None) -> dict[str | None, float] | None:
    """The router's tier weights as a dict, or ValueError naming what is wrong."""
    if weights is None:
        return None
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError("tier_weights: expected a non-empty mapping of medium name -> weight")
    out: dict[str | None, float] = {}
    for m, w in weights.items():
        if m is not None and not isinstance(m, str):
            raise ValueError(f"tier_weights: a medium must be a name (str) or None, got {m!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"tier_weights: the weight of medium {m!r} must be a finite number >= 0, got {w!r}")
        out[m] = float(w)
    if medium is not None:
        raise ValueError("tier_weights and medium: give one (the weights already choose the media)")
    if getattr(index, "speculative", False):
        raise ValueError("tier_weights with a speculative index: not supported (speculative entries have no medium)")
    if index is not None and not hasattr(index, "match_weighted"):
        raise ValueError(f"tier_weights: the index ({type(index).__name__}) has no match_weighted "
                         "(use PrefixIndex or DictIndex)")
    return out
