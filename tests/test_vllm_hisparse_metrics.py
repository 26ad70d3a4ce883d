"""vLLM's KV-cache residency metrics (``--kv-cache-metrics``, a ``metrics_collector``) with a
HiSparse host tier, on kvblock's manager (``kvblock.vllm.hisparse.HostBlockPool``'s
``metrics_collector`` over the Rust host pool's residency, ``rust/src/py/manager/hisparse_metrics.rs``).

vLLM's ``HiSparseSourceManager.bind_host_pool`` builds its host pool with a collector of its own,
``KVCacheMetricsCollector(device_pool.metrics_collector.sample_rate)``: the host pool records its
own births, hits and evictions. kvblock does the same in Rust:

* Lockstep against vLLM's own manager and ``HiSparseCoordinator`` with a collector at rate 1.0
  (every block sampled, so vLLM's ``random.random() < rate`` is deterministic; as
  ``tests/test_vllm_metrics.py`` does for the device pool), driven by the HiSparse manager
  lockstep's state machine (``tests/test_vllm_hisparse_manager.py``): after every step the device
  collectors and the host collectors agree on the sampled blocks (dict order), their access-history
  lengths and the pending eviction events (order, reuse-gap counts); the collectors are drained
  now and then, and the host collector's ``sample_rate`` is set to rates that sample every block
  or none, on both sides.
* The host collector is vLLM's class, its own object, at the device collector's rate; its
  ``drain_events()`` gives vLLM's ``KVCacheEvictionEvent``.
* Host sampling at rate 0.25 is Bernoulli (a seeded statistical test).
* ``reset_prefix_cache`` resets the host pool and its collector too, as vLLM's coordinator
  resets every group's pool.
* A device collector whose ``sample_rate`` vLLM's ``bind_host_pool`` refuses raises vLLM's
  ``AssertionError`` (vLLM raises it at ``get_hisparse_coordinator``), nothing built and the
  collector untouched.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from conftest import require_module
from fresh_interpreter import run_alone

require_module("vllm")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import initialize, invariant, rule  # noqa: E402

pytest.importorskip("vllm.v1.hisparse.coordinator")

from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector  # noqa: E402
from vllm.v1.metrics.stats import KVCacheEvictionEvent  # noqa: E402

import kvblock.vllm.manager as kvm  # noqa: E402
from kvblock.vllm import metrics as km  # noqa: E402
from kvblock.vllm.config import translate  # noqa: E402
from test_vllm_hisparse_manager import (  # noqa: E402
    BS,
    HiSparseCoordinatorView,
    HiSparseManagerLockstep,
    KvblockManager,
    Request,
    VllmManager,
    _config,
    get_request_block_hasher,
    hisparse,
    init_none_hash,
    sha256,
)

EXAMPLES = int(os.environ.get("KVBLOCK_LOCKSTEP_EXAMPLES", "60"))
#: What the run reached (checked by ``test_hisparse_metrics_lockstep``).
COVERAGE: Counter[str] = Counter()


def _residency(c) -> tuple:
    """Sampled blocks in dict order with their access-history lengths; pending events as
    their reuse-gap counts, in order."""
    return ([(b, len(s.access_history)) for b, s in c.block_metrics.items()],
            [len(e.reuse_gaps_seconds) for e in c._eviction_events])


def _host_collector(coordinator):
    return coordinator.host_manager.block_pool.metrics_collector


class HiSparseMetricsLockstep(HiSparseManagerLockstep):
    @initialize(
        num_blocks=st.integers(12, 48),
        host_num_blocks=st.integers(6, 32),
        max_in_flight_tokens=st.sampled_from([None, 32, 48]),
        # evictions are recorded with caching on: mostly on
        caching=st.sampled_from([True, True, False]),
        events=st.booleans(),
    )
    def setup(self, num_blocks: int, host_num_blocks: int, max_in_flight_tokens, caching: bool, events: bool) -> None:
        # the parent's setup, with a collector on each side
        self.collectors = (KVCacheMetricsCollector(1.0), KVCacheMetricsCollector(1.0))
        args = dict(
            max_model_len=128,
            scheduler_block_size=BS,
            hash_block_size=BS,
            max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=caching,
            enable_kv_cache_events=events,
        )
        self.vm = VllmManager(_config(num_blocks, host_num_blocks), metrics_collector=self.collectors[0], **args)
        self.vc = hisparse.get_hisparse_coordinator(self.vm)
        self.km = KvblockManager(_config(num_blocks, host_num_blocks), metrics_collector=self.collectors[1], **args)
        assert type(self.km).__module__.startswith("kvblock"), "kvblock's manager must hold the HiSparse groups"
        self.kc = hisparse.get_hisparse_coordinator(self.km)
        assert isinstance(self.kc, HiSparseCoordinatorView)
        self.requests: dict[str, Request] = {}
        self.sent: list[int] = []
        self.outsiders: list[tuple[list, list]] = []
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        self.host_collectors = (_host_collector(self.vc), _host_collector(self.kc))
        self.host_outsiders_held: list[list] = []

    @rule()
    def drain(self) -> None:
        # the scheduler drains the device collector once per stats interval; nothing in vLLM
        # drains the host collector, but it is vLLM's API, so both are compared drained
        for pair, name in ((self.collectors, "device"), (self.host_collectors, "host")):
            ev, ek = pair[0].drain_events(), pair[1].drain_events()
            assert all(type(e) is KVCacheEvictionEvent for e in ek)
            assert [len(e.reuse_gaps_seconds) for e in ev] == [len(e.reuse_gaps_seconds) for e in ek], name
            COVERAGE[f"{name} drained"] += len(ek)

    @rule(rate=st.sampled_from([-1.0, 2.0, 1.0]))
    def host_sample_rate(self, rate: float) -> None:
        # vLLM reads the attribute at every allocation: above 1 samples every block, below 0 none
        for c in self.host_collectors:
            c.sample_rate = rate
        COVERAGE["host sampling off"] += rate < 0

    @rule(n=st.integers(1, 4), all_free=st.booleans(), touches=st.integers(0, 3))
    def host_outsiders(self, n: int, all_free: bool, touches: int) -> None:
        # code outside the manager (a connector) takes host blocks (all free ones: sampled
        # blocks handed out again, evicted) and touches them: births, accesses and evictions of
        # host blocks (the state machine drives no host prefix hits)
        pools = [c.host_manager.block_pool for c in (self.vc, self.kc)]
        free = pools[0].get_num_free_blocks()
        n = free if all_free else n
        if n == 0 or n > free:
            return
        if all_free:
            # twice: the blocks sampled the first time are evicted the second (caching on)
            for p in pools:
                p.free_blocks(p.get_new_blocks(n))
        taken = [p.get_new_blocks(n) for p in pools]
        assert [b.block_id for b in taken[0]] == [b.block_id for b in taken[1]]
        for p, blocks in zip(pools, taken):
            for _ in range(touches):
                # a hit: a reference taken and dropped again
                p.touch(blocks)
                p.free_blocks(blocks)
        self.host_outsiders_held.append(taken)
        COVERAGE["host outsiders"] += 1

    @rule()
    def release_host_outsiders(self) -> None:
        if self.host_outsiders_held:
            taken = self.host_outsiders_held.pop(0)
            for c, blocks in zip((self.vc, self.kc), taken):
                c.host_manager.block_pool.free_blocks(blocks)

    @invariant()
    def same_metrics(self) -> None:
        if not hasattr(self, "km"):
            return
        assert _residency(self.collectors[0]) == _residency(self.collectors[1])
        hv, hk = _residency(self.host_collectors[0]), _residency(self.host_collectors[1])
        assert hv == hk, (hv, hk)
        COVERAGE["host sampled"] += bool(hk[0])
        COVERAGE["host accessed"] += any(n for _, n in hk[0])
        COVERAGE["host events"] += len(hk[1])
        COVERAGE["host reuse gaps"] += sum(1 for n in hk[1] if n)
        COVERAGE["device events"] += len(_residency(self.collectors[1])[1])


def test_hisparse_metrics_lockstep():
    # in an interpreter of its own (see tests/fresh_interpreter.py)
    if run_alone(__file__, "test_hisparse_metrics_lockstep"):
        return
    HiSparseMetricsLockstep.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        # the same examples every run, so that the coverage check below cannot flake
        derandomize=True,
        database=None,
    )
    HiSparseMetricsLockstep.TestCase().runTest()
    assert all(
        COVERAGE[k]
        for k in (
            "device events", "host events", "host drained", "host sampled", "host accessed", "host sampling off",
            "host outsiders",
        )
    ), COVERAGE


def test_host_evictions_with_reuse_gaps_agree_with_vllms():
    # the lockstep machine by hand: requests on both tiers, host blocks touched by other code,
    # then every free host block handed out again (the sampled ones evicted, with their gaps)
    m = HiSparseMetricsLockstep()
    m.setup(num_blocks=32, host_num_blocks=16, max_in_flight_tokens=None, caching=True, events=True)
    m.admit(request="r0", prompt=64, external=0, must_fit=False)
    m.connector_step()
    m.same_metrics()
    m.host_outsiders(n=3, all_free=False, touches=3)
    m.same_metrics()
    m.release_host_outsiders()
    m.free(request="r0", finished=True)
    m.host_outsiders(n=0, all_free=True, touches=0)
    m.same_metrics()
    events = [c.drain_events() for c in m.host_collectors]
    assert [len(e.reuse_gaps_seconds) for e in events[0]] == [len(e.reuse_gaps_seconds) for e in events[1]]
    assert sorted(len(e.reuse_gaps_seconds) for e in events[1]).count(2) == 3
    m.release_host_outsiders()
    m.same_metrics()
    # the device pool's, drained as the scheduler drains them: other code takes every free block
    m.other_allocations(n=0, all_free=True)
    m.same_metrics()
    events = [c.drain_events() for c in m.collectors]
    assert len(events[1]) > 0 and all(type(e) is KVCacheEvictionEvent for e in events[1])
    assert [len(e.reuse_gaps_seconds) for e in events[0]] == [len(e.reuse_gaps_seconds) for e in events[1]]


def test_reset_prefix_cache_resets_both_pools_and_collectors_as_vllm():
    # vLLM's coordinator resets every group's pool once (the host pool's too, whose collector
    # is reset with it); a pool with a block in use refuses, the others are still reset
    m = HiSparseMetricsLockstep()
    m.setup(num_blocks=32, host_num_blocks=16, max_in_flight_tokens=None, caching=True, events=True)
    m.admit(request="r0", prompt=64, external=0, must_fit=False)
    m.connector_step()
    m.host_outsiders(n=2, all_free=False, touches=1)
    m.free(request="r0", finished=True)
    m.connector_step()
    m.same_tables_and_pools()
    m.same_metrics()
    host = m.kc.host_manager.block_pool
    assert any(b.block_hash is not None for b in host.blocks) and len(m.collectors[1].block_metrics) > 0
    # a host block held by other code: the host pool refuses, the device pool resets
    assert m.vm.reset_prefix_cache() is m.km.reset_prefix_cache() is False
    m.same_metrics()
    assert len(m.collectors[1].block_metrics) == 0 and len(m.host_collectors[1].block_metrics) > 0
    m.release_host_outsiders()
    assert m.vm.reset_prefix_cache() is m.km.reset_prefix_cache() is True
    m.same_tables_and_pools()
    m.same_metrics()
    assert len(m.host_collectors[1].block_metrics) == 0 and m.host_collectors[1].drain_events() == []
    assert all(b.block_hash is None for b in host.blocks)
    assert [b.block_hash is None for b in m.vc.host_manager.block_pool.blocks] == [b.block_hash is None for b in host.blocks]
    # the coordinator's own call (vLLM's KVCacheCoordinator.reset_prefix_cache) does the same
    assert m.vm.coordinator.reset_prefix_cache() is m.km.coordinator.reset_prefix_cache() is True


def test_the_host_pool_has_its_own_collector_at_the_device_rate():
    c = KVCacheMetricsCollector(0.5)
    assert translate(_config(32, 16), metrics_collector=c).on_kvblock
    m = KvblockManager(_config(32, 16), max_model_len=128, scheduler_block_size=BS, hash_block_size=BS,
                       metrics_collector=c)
    assert type(m) is KvblockManager and m.metrics_collector is c
    host = hisparse.get_hisparse_coordinator(m).host_manager.block_pool
    hc = host.metrics_collector
    assert isinstance(hc, KVCacheMetricsCollector) and hc is not c and hc.sample_rate == 0.5
    assert m.block_pool.metrics_collector is c
    # host blocks: sampled, touched, evicted by reallocation (caching on) into the host collector
    hc.sample_rate = 1.0
    blocks = host.get_new_blocks(2)
    assert list(hc.block_metrics) == [b.block_id for b in blocks] and len(c.block_metrics) == 0
    host.touch(blocks)
    host.touch(blocks)
    assert [len(s.access_history) for s in hc.block_metrics.values()] == [2, 2]
    for _ in range(3):
        host.free_blocks(blocks)
    host.get_new_blocks(host.get_num_free_blocks())
    events = hc.drain_events()
    assert len(events) == 2 and all(type(e) is KVCacheEvictionEvent and len(e.reuse_gaps_seconds) == 1 for e in events)
    assert c.drain_events() == [] and hc.drain_events() == []
    # the hooks and block_metrics edits reach the Rust host pool; bad ids raise, changing nothing
    hc.block_metrics[3] = km._state(1, 2, [2])
    assert host._residency_get(3) == (1, 2, [2])
    with pytest.raises(KeyError):
        hc.block_metrics[16] = km._state(1, 2, [2])
    with pytest.raises(ValueError):
        host._residency_hook("accessed", 16)
    with pytest.raises(ValueError):
        host._residency_hook("born", 3)
    assert host._residency_get(3) == (1, 2, [2])


def test_without_a_collector_the_host_pool_records_nothing():
    m = KvblockManager(_config(32, 16), max_model_len=128, scheduler_block_size=BS, hash_block_size=BS)
    host = hisparse.get_hisparse_coordinator(m).host_manager.block_pool
    assert host.metrics_collector is None and not host._residency_on()
    host.get_new_blocks(2)
    assert host._residency_len() == 0 and host._residency_num_pending() == 0


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.0000001, 2.0, float("nan")])
def test_a_rate_bind_host_pool_refuses_raises_vllms_assertion_with_nothing_built(rate):
    # vLLM: the manager builds; its coordinator's bind_host_pool raises at the first
    # get_hisparse_coordinator (KVCacheMetricsCollector(rate) asserts the range)
    cv = KVCacheMetricsCollector(1.0)
    cv.sample_rate = rate
    vm = VllmManager(_config(32, 16), max_model_len=128, scheduler_block_size=BS, hash_block_size=BS,
                     metrics_collector=cv)
    with pytest.raises(AssertionError, match="sample_rate must be in") as theirs:
        hisparse.get_hisparse_coordinator(vm)
    # kvblock: the same exception from its constructor, nothing built, the collector untouched
    ck = KVCacheMetricsCollector(1.0)
    ck.sample_rate = rate
    built = kvm.kvblock_counter[0]
    with pytest.raises(AssertionError, match="sample_rate must be in") as ours:
        KvblockManager(_config(32, 16), max_model_len=128, scheduler_block_size=BS, hash_block_size=BS,
                       metrics_collector=ck)
    assert str(ours.value) == str(theirs.value)
    assert kvm.kvblock_counter[0] == built
    assert type(ck) is KVCacheMetricsCollector and vars(ck)["block_metrics"] == {} and vars(ck)["_eviction_events"] == []
    # and the same collector binds once its rate is one vLLM takes
    ck.sample_rate = 1.0
    m = KvblockManager(_config(32, 16), max_model_len=128, scheduler_block_size=BS, hash_block_size=BS,
                       metrics_collector=ck)
    assert type(m) is KvblockManager and type(ck) is km.KVCacheMetricsCollector


def test_a_hisparse_configuration_with_a_collector_goes_to_kvblock():
    # no fallback for HiSparse with residency metrics: kvblock's manager holds both
    c = KVCacheMetricsCollector(1.0)
    path = translate(_config(32, 16), metrics_collector=c)
    assert path.on_kvblock and path.hisparse_host_num_blocks == 16


def test_host_sampling_at_a_rate_below_one_is_bernoulli():
    """At the device collector's rate 0.25 every host allocation is sampled with probability
    0.25: over 20,000 host allocations the number sampled lies within 6 standard deviations of
    5,000 (seeded through Python's ``random``, which seeds the host pool's generator when its
    collector binds), as ``tests/test_vllm_metrics.py`` checks for the device pool."""
    import math
    import random

    rate, blocks, rounds = 0.25, 200, 100
    random.seed(1234)
    m = KvblockManager(_config(32, blocks + 1), max_model_len=128, scheduler_block_size=BS, hash_block_size=BS,
                       metrics_collector=KVCacheMetricsCollector(rate))
    host = hisparse.get_hisparse_coordinator(m).host_manager.block_pool
    hc = host.metrics_collector
    n = 0
    for _ in range(rounds):
        got = host.get_new_blocks(blocks)
        host.free_blocks(got)
        n += len(hc.drain_events())
    n += len(hc.block_metrics)  # every sampled allocation: evicted since, or held
    trials = blocks * rounds
    assert abs(n - trials * rate) < 6 * math.sqrt(trials * rate * (1 - rate)), n


def test_a_dropped_manager_leaves_its_unread_host_events_to_the_collector():
    # as the device pool's: the host pool view's finalizer moves the Rust events not read yet
    # into the collector's list, and the manager and its host pool go in one collection
    import gc
    import weakref

    m = KvblockManager(_config(32, 16), max_model_len=128, scheduler_block_size=BS, hash_block_size=BS,
                       metrics_collector=KVCacheMetricsCollector(1.0))
    host = hisparse.get_hisparse_coordinator(m).host_manager.block_pool
    hc = host.metrics_collector
    host.free_blocks(host.get_new_blocks(3))
    host.get_new_blocks(15)  # every free host block: the 3 sampled ones evicted
    assert host._residency_num_pending() == 3
    refs = [weakref.ref(m), weakref.ref(host)]
    del m, host
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert len(hc.drain_events()) == 3 and len(hc.block_metrics) == 0
