"""The Rust block pool and the pure-Python reference, driven in lockstep by a hypothesis state
machine through random allocate / touch / cache / free / evict / reset / lookup sequences,
with caching on and off and KV events on. After every step: the same block ids, exceptions,
free-queue order, ref counts, block hashes, hash -> block map and events.

``KVBLOCK_LONG=1`` runs the long profile (20,000 examples); ``KVBLOCK_LOCKSTEP_EXAMPLES=N`` sets the
number of examples (the smoke runs on other Pythons use a few)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvblock import hashing as H
from kvblock.block_pool import BlockPool
from kvblock.reference.block_pool import BlockPool as RefBlockPool
from kvblock.request import LoRARequest, Request

BS = 2
LONG = bool(os.environ.get("KVBLOCK_LONG"))


def _map(pool) -> dict[bytes, list[int]]:
    out: dict[bytes, list[int]] = {}
    for key, v in pool.cached_block_hash_to_block.items():
        out.setdefault(key, []).extend(v if isinstance(v, list) else [v.block_id])
    return out


class PoolLockstep(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 14),
        caching=st.booleans(),
        events=st.booleans(),
    )
    def setup(self, num_blocks, caching, events):
        self.fast = BlockPool(num_blocks, caching, BS, enable_kv_cache_events=events)
        self.ref = RefBlockPool(num_blocks, caching, BS, enable_kv_cache_events=events)
        self.n = num_blocks
        self.owned: list[tuple[list[int], object]] = []  # (ids, reference blocks), one per allocation/touch
        self.requests: list[Request] = []

    def _both(self, f_fast, f_ref):
        try:
            a = f_fast()
        except (ValueError, RuntimeError, KeyError, TypeError, AssertionError) as e:
            a = e
        try:
            b = f_ref()
        except (ValueError, RuntimeError, KeyError, TypeError, AssertionError) as e:
            b = e
        if isinstance(a, Exception) or isinstance(b, Exception):
            assert isinstance(a, Exception) and isinstance(b, Exception), (a, b)
            assert type(a) is type(b) or isinstance(b, AssertionError), (a, b)
            return None
        return a, b

    @rule(n=st.integers(-1, 6))
    def allocate(self, n):
        r = self._both(lambda: self.fast.get_new_blocks(n), lambda: self.ref.get_new_blocks(n))
        if r is not None:
            a, b = r
            assert [x.block_id for x in a] == [x.block_id for x in b]
            if a:
                self.owned.append(([x.block_id for x in a], b))

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.owned) - 1))
        ids, ref_blocks = self.owned.pop(i)
        fast_blocks = [self.fast.blocks[b] for b in ids]
        self._both(lambda: self.fast.free_blocks(reversed(fast_blocks)), lambda: self.ref.free_blocks(reversed(ref_blocks)))

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def touch(self, data):
        ids, ref_blocks = data.draw(st.sampled_from(self.owned))
        self._both(lambda: self.fast.touch([self.fast.blocks[b] for b in ids]), lambda: self.ref.touch(ref_blocks))
        self.owned.append((list(ids), list(ref_blocks)))

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), prefix=st.integers(0, 2), lora=st.booleans())
    def cache(self, data, prefix, lora):
        ids, ref_blocks = data.draw(st.sampled_from(self.owned))
        n = len(ids)
        # a few shared prefixes make duplicate keys (two blocks computed independently)
        tokens = [prefix] * (BS * n) if data.draw(st.booleans()) else data.draw(
            st.lists(st.integers(0, 3), min_size=BS * n, max_size=BS * n)
        )
        req = Request(f"r{len(self.requests)}", tokens + [9],
                      lora_request=LoRARequest("l", 7, "/l") if lora else None,
                      block_hasher=H.get_request_block_hasher(BS, H.sha256))
        self.requests.append(req)
        start = data.draw(st.integers(0, n))
        group = data.draw(st.sampled_from([0, 0, 1]))
        self._both(
            lambda: self.fast.cache_full_blocks(req, [self.fast.blocks[b] for b in ids], start, n, BS, group),
            lambda: self.ref.cache_full_blocks(req, ref_blocks, start, n, BS, group),
        )

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), group=st.sampled_from([0, 1]))
    def lookup(self, data, group):
        req = data.draw(st.sampled_from(self.requests))
        for h in req.block_hashes:
            a = self.fast.get_cached_block(h, [group])
            b = self.ref.get_cached_block(h, [group])
            assert (a is None) == (b is None)
            if a is not None:
                assert [x.block_id for x in a] == [x.block_id for x in b]

    @rule(ids=st.lists(st.integers(0, 15), max_size=4))
    def evict(self, ids):
        self._both(lambda: self.fast.evict_blocks(ids), lambda: self.ref.evict_blocks(ids))

    @rule()
    def reset(self):
        r = self._both(self.fast.reset_prefix_cache, self.ref.reset_prefix_cache)
        assert r is not None and r[0] == r[1]

    @rule(bad=st.sampled_from(["double_free", "out_of_range", "null_free"]))
    def bad_input(self, bad):
        """Bad input raises and changes nothing (the invariant check runs right after)."""
        if bad == "out_of_range":
            with pytest.raises(ValueError):
                self.fast.free_ids([self.n + 3])
        elif bad == "null_free":
            with pytest.raises(ValueError):
                self.fast.free_ids([0])
        else:
            free = [b for b in range(1, self.n) if self.fast.ref_cnt(b) == 0]
            if free:
                with pytest.raises(ValueError):
                    self.fast.free_ids([free[0]])

    @invariant()
    def same_state(self):
        if not hasattr(self, "fast"):
            return
        f, r = self.fast, self.ref
        assert [b.block_id for b in f.free_block_queue.get_all_free_blocks()] == [
            b.block_id for b in r.free_block_queue.get_all_free_blocks()
        ]
        assert f.get_num_free_blocks() == r.get_num_free_blocks()
        assert f.get_usage() == pytest.approx(r.get_usage())
        for i in range(1, self.n):
            assert f.blocks[i].ref_cnt == r.blocks[i].ref_cnt, i
            assert f.blocks[i].block_hash == r.blocks[i].block_hash, i
        assert _map(f) == _map(r)
        assert len(f.cached_block_hash_to_block) == len(r.cached_block_hash_to_block)
        assert f.take_events() == r.take_events()
        f.check_invariants()


PoolLockstep.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVBLOCK_LOCKSTEP_EXAMPLES") or (20000 if LONG else 2000)),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolLockstep = PoolLockstep.TestCase
