"""vLLM's KV-cache residency metrics (``--kv-cache-metrics``, a ``metrics_collector``) on
kvblock's Rust pool (issue 33, build item 2; :mod:`kvblock.vllm.metrics`).

* Which path a collector takes: vLLM's ``KVCacheMetricsCollector`` (and subclasses overriding
  no hook) on kvblock, in strict mode too; a collector kvblock cannot feed falls back with its
  reason; a bad sample rate raises vLLM's own exception where vLLM raises it.
* The collector the scheduler holds is the object it passed, and what vLLM's scheduler reads
  of it is true: ``drain_events()`` (vLLM's own method) returns vLLM's
  ``KVCacheEvictionEvent`` objects; ``reset()``; ``block_metrics`` as a live view.
* The values: kvblock's clock is ``time.monotonic_ns``'s, the reuse gaps are the differences of
  the access history, the lifetime spans birth to eviction.
* Lockstep against vLLM's own manager and collector at sample rate 1.0 (and at rates outside
  (0, 1], which vLLM's comparison makes deterministic) on a shared-prefix workload with hits,
  preemption-free eviction pressure and connector evictions: the sampled blocks (dict order),
  their access-history lengths and the eviction events (order, reuse-gap counts) agree.
* A statistical test of sampling at rate 0.25 (seeded, so it is reproducible).
"""

from __future__ import annotations

import gc
import math
import random
import time

import pytest

from conftest import require_module

vllm = require_module("vllm")

import torch  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.metrics.stats import KVCacheEvictionEvent  # noqa: E402

import kvblock.vllm as kv  # noqa: E402
from kvblock.vllm import metrics as km  # noqa: E402
from kvblock.vllm.manager import VllmKVCacheManager  # noqa: E402
from kvblock.vllm.originals import original  # noqa: E402
from vllm_oracle import init_none_hash, request  # noqa: E402

from vllm.v1.core import block_pool as _vbp  # noqa: E402

VllmBlockPool = original(_vbp, "BlockPool")

BS = 4


def _config(num_blocks: int = 16) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])


def _manager(cls, collector, num_blocks: int = 16, **kw):
    init_none_hash(sha256)
    return cls(_config(num_blocks), 64, BS, BS, enable_caching=True, metrics_collector=collector, **kw)


# -- which path --------------------------------------------------------------------------------


def test_a_vllm_collector_runs_on_kvblock_in_strict_mode(monkeypatch):
    monkeypatch.setenv("KVBLOCK_VLLM_STRICT", "1")
    c = KVCacheMetricsCollector(0.5)
    path = kv.describe(_config(), metrics_collector=c)
    assert path.on_kvblock and str(path) == "kvblock"
    assert type(c) is KVCacheMetricsCollector, "describe() changes nothing"
    m = _manager(kv.KVCacheManager, c)
    assert type(m) is kv.KVCacheManager
    # the scheduler's object, still vLLM's class (a subclass), its rate kept
    assert m.metrics_collector is c and m.block_pool.metrics_collector is c
    assert isinstance(c, KVCacheMetricsCollector) and type(c) is km.KVCacheMetricsCollector
    assert c.sample_rate == 0.5 and m.block_pool._residency_on()


def test_a_collector_subclass_without_hooks_runs_on_kvblock():
    class Named(KVCacheMetricsCollector):
        def __init__(self, sample_rate: float = 0.01) -> None:
            super().__init__(sample_rate)
            self.name = "mine"

    c = Named(1.0)
    m = _manager(kv.KVCacheManager, c)
    assert type(m) is kv.KVCacheManager and isinstance(c, Named) and c.name == "mine"
    m.block_pool.get_new_blocks(2)
    assert list(c.block_metrics) == [1, 2]


class _OwnHook(KVCacheMetricsCollector):
    def on_block_allocated(self, block) -> None:  # a Python hook per block: vLLM's manager runs it
        super().on_block_allocated(block)


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: _OwnHook(1.0), "overrides on_block_allocated"),
        (lambda: object(), "not vLLM's KVCacheMetricsCollector"),
        (lambda: _with_rate(KVCacheMetricsCollector(), "0.5"), "not a number"),
    ],
    ids=["hook-override", "not-a-collector", "rate-not-a-number"],
)
def test_collectors_kvblock_cannot_feed_fall_back_with_the_reason(monkeypatch, make, words):
    c = make()
    cls = type(c)
    path = kv.describe(_config(), metrics_collector=c)
    assert not path.on_kvblock and words in path.reason and "metrics" in path.reason
    monkeypatch.delenv("KVBLOCK_VLLM_STRICT", raising=False)
    m = _manager(kv.KVCacheManager, c)
    assert type(m) is VllmKVCacheManager and m.metrics_collector is c
    monkeypatch.setenv("KVBLOCK_VLLM_STRICT", "1")
    with pytest.raises(kv.UnsupportedConfiguration, match="metrics"):
        _manager(kv.KVCacheManager, c)
    assert type(c) is cls
    # kvblock's pool built directly refuses it: a TypeError, nothing built
    with pytest.raises(TypeError, match=words.split()[-1]):
        kv.BlockPool(8, True, BS, metrics_collector=c)
    assert type(c) is cls


def _with_rate(c, rate):
    c.sample_rate = rate
    return c


def test_a_collector_feeds_one_kvblock_pool_at_a_time():
    """vLLM shares one collector's dict between the pools given it; kvblock's pool keeps one
    pool's state, so a second manager given a bound collector runs on vLLM's manager, whose
    pool calls the collector's hooks: they land in the first pool's state, keyed by block id,
    as vLLM's shared dict would have it."""
    c = KVCacheMetricsCollector(1.0)
    a = _manager(kv.KVCacheManager, c)
    path = kv.describe(_config(), metrics_collector=c)
    assert not path.on_kvblock and "another kvblock pool" in path.reason
    b = _manager(kv.KVCacheManager, c)
    assert type(b) is VllmKVCacheManager
    b.block_pool.get_new_blocks(2)
    assert list(c.block_metrics) == [1, 2]
    a.block_pool.get_new_blocks(1)  # block 1 of a: the same key in the shared state
    assert list(c.block_metrics) == [2, 1] and len(c.drain_events()) == 1


def test_a_collector_whose_pool_is_gone_binds_again():
    c = KVCacheMetricsCollector(1.0)
    pool = kv.BlockPool(8, True, BS, metrics_collector=c)
    pool.get_new_blocks(1)
    pool.evict_blocks({1})
    del pool
    gc.collect()
    # its samples went with it, its events stay
    assert km._pool_of(c) is None and len(c.block_metrics) == 0 and len(c._eviction_events) == 1
    assert kv.describe(_config(), metrics_collector=c).on_kvblock
    m = _manager(kv.KVCacheManager, c)
    assert type(m) is kv.KVCacheManager and len(c.drain_events()) == 1 and c.sample_rate == 1.0
    m.block_pool.get_new_blocks(1)
    assert list(c.block_metrics) == [1]


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0, 0.0, -0.1, 1.0000001, 2, float("nan")])
def test_a_sample_rate_out_of_range_raises_vllms_exceptions_where_vllm_raises(rate):
    # the collector's constructor (vLLM's own, unchanged) asserts the range; the engine's
    # configuration refuses it before a scheduler (and so a manager) exists
    with pytest.raises(AssertionError, match="sample_rate must be in"):
        KVCacheMetricsCollector(rate)
    from pydantic import ValidationError
    from vllm.config import ObservabilityConfig

    with pytest.raises(ValidationError, match="kv_cache_metrics_sample"):
        ObservabilityConfig(kv_cache_metrics=True, kv_cache_metrics_sample=rate)


def test_a_manager_that_fails_to_build_leaves_the_collector_alone():
    c = KVCacheMetricsCollector(1.0)
    with pytest.raises(AssertionError):
        _manager(kv.KVCacheManager, c, watermark=-1.0)
    assert type(c) is KVCacheMetricsCollector and "block_metrics" in vars(c)
    c.block_metrics[999] = km._state(1, 2, [2])  # a state naming a block no pool of 8 has
    with pytest.raises(ValueError, match="not a block id"):
        kv.BlockPool(8, True, BS, metrics_collector=c)
    assert type(c) is KVCacheMetricsCollector and list(c.block_metrics) == [999]
    # a manager hands it to vLLM's, which keeps such states as they are
    path = kv.describe(_config(16), metrics_collector=c)
    assert not path.on_kvblock and "outside a pool of 16" in path.reason
    # one naming a block of the pool is carried into the Rust state
    c2 = KVCacheMetricsCollector(1.0)
    c2.block_metrics[3] = km._state(11, 12, [12])
    m = _manager(kv.KVCacheManager, c2)
    assert type(m) is kv.KVCacheManager and list(c2.block_metrics) == [3]
    s = c2.block_metrics[3]
    assert (s.birth_time_ns, s.last_access_ns, list(s.access_history)) == (11, 12, [12])


def test_view_misuse_raises_python_errors():
    c = KVCacheMetricsCollector(1.0)
    pool = kv.BlockPool(8, True, BS, metrics_collector=c)
    view = c.block_metrics
    for key in (-1, 8, "1", True, None):
        assert key not in view
        with pytest.raises(KeyError):
            view[key]
        with pytest.raises(KeyError):
            del view[key]
    with pytest.raises(KeyError):
        view[8] = km._state(1, 1, [])
    with pytest.raises(TypeError, match="real number"):
        c.sample_rate = "all"
    assert c.sample_rate == 1.0
    with pytest.raises(ValueError, match="kind"):
        pool._residency_hook("touched", 1)
    pool.get_new_blocks(1)
    assert list(view) == [1]


# -- what the scheduler reads ------------------------------------------------------------------


def test_drain_events_reset_and_reset_prefix_cache_as_vllm():
    c = KVCacheMetricsCollector(1.0)
    m = _manager(kv.KVCacheManager, c, num_blocks=6)
    pool = m.block_pool
    blocks = pool.get_new_blocks(3)
    pool.touch(blocks[:1])
    pool.free_blocks(blocks)
    pool.free_blocks(blocks[:1])
    pool.get_new_blocks(5)  # every block handed out again: 3 sampled ones evicted
    events = c.drain_events()  # vLLM's own method
    assert [type(e) for e in events] == [KVCacheEvictionEvent] * 3
    assert sorted(len(e.reuse_gaps_seconds) for e in events) == [0, 0, 0]
    assert c.drain_events() == [] and len(c.block_metrics) == 5
    pool.evict_blocks({1, 2})
    assert len(c._eviction_events) == 2 and len(c.block_metrics) == 3
    # a failed reset changes nothing
    assert not m.reset_prefix_cache()
    assert len(c._eviction_events) == 2 and len(c.block_metrics) == 3
    pool.free_blocks(pool.blocks[1:6])
    assert m.reset_prefix_cache()
    assert len(c.block_metrics) == 0 and c.drain_events() == []
    # reset() itself: vLLM's method on the live state
    pool.get_new_blocks(2)
    pool.evict_blocks({1})
    c.reset()
    assert len(c.block_metrics) == 0 and c._eviction_events == []


def test_the_scheduler_reads_the_events_into_its_stats():
    """vLLM's own scheduler (as kvblock.vllm.Scheduler runs it) with ``--kv-cache-metrics``:
    its collector is fed by kvblock's pool and ``make_stats()`` carries the events."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "benches"))
    import vllm_sched as sched_mod
    wl = sched_mod.shared_workload(24, BS * 4)
    with sched_mod.engine("kvblock", wl.block_size) as eng:
        sched = sched_mod.make_scheduler(eng, wl, kv_cache_metrics_sample=1.0)
        assert type(sched.kv_cache_manager) is kv.KVCacheManager
        assert sched.kv_cache_manager.metrics_collector is sched.kv_metrics_collector
        assert type(sched.kv_metrics_collector) is km.KVCacheMetricsCollector
        pool = sched.kv_cache_manager.block_pool
        pool.get_new_blocks(3)
        pool.evict_blocks({1, 2, 3})
        stats = sched.make_stats()
        assert [type(e) for e in stats.kv_cache_eviction_events] == [KVCacheEvictionEvent] * 3
        assert sched.make_stats().kv_cache_eviction_events == []


# -- the values --------------------------------------------------------------------------------


def test_times_are_time_monotonic_ns_and_events_are_their_differences():
    c = KVCacheMetricsCollector(1.0)
    pool = kv.BlockPool(8, True, BS, metrics_collector=c)
    t0 = time.monotonic_ns()
    (b,) = pool.get_new_blocks(1)
    t1 = time.monotonic_ns()
    s = c.block_metrics[b.block_id]
    assert t0 <= s.birth_time_ns <= t1 and s.last_access_ns == s.birth_time_ns and not s.access_history
    windows = []
    for _ in range(6):
        t0 = time.monotonic_ns()
        pool.touch([b])
        windows.append((t0, time.monotonic_ns()))
    s = c.block_metrics[b.block_id]
    hist = list(s.access_history)
    assert len(hist) == 4  # bounded, the last four
    assert all(lo <= t <= hi for t, (lo, hi) in zip(hist, windows[2:]))
    assert s.last_access_ns == hist[-1]
    t0 = time.monotonic_ns()
    pool.evict_blocks({b.block_id})
    t1 = time.monotonic_ns()
    (e,) = c.drain_events()
    # vLLM's own event, as its constructor makes it
    assert type(e) is KVCacheEvictionEvent and e == KVCacheEvictionEvent(**vars(e))
    assert list(vars(e)) == ["lifetime_seconds", "idle_seconds", "reuse_gaps_seconds"]
    assert type(e.reuse_gaps_seconds) is tuple and type(e.lifetime_seconds) is float
    # vLLM's arithmetic: nanosecond differences / 1e9
    assert e.reuse_gaps_seconds == tuple((hist[i] - hist[i - 1]) / 1e9 for i in range(1, 4))
    assert (t0 - s.birth_time_ns) / 1e9 <= e.lifetime_seconds <= (t1 - s.birth_time_ns) / 1e9
    assert (t0 - hist[-1]) / 1e9 <= e.idle_seconds <= (t1 - hist[-1]) / 1e9
    assert math.isclose(e.lifetime_seconds - e.idle_seconds, (hist[-1] - s.birth_time_ns) / 1e9, abs_tol=2e-9)


def test_block_metrics_is_a_live_view_in_vllms_dict_order():
    c = KVCacheMetricsCollector(1.0)
    pool = kv.BlockPool(8, False, BS, metrics_collector=c)
    blocks = pool.get_new_blocks(3)
    view = c.block_metrics
    assert list(view) == [1, 2, 3] and len(view) == 3 and 2 in view and 7 not in view
    # caching off: a block handed out again is sampled afresh in place (vLLM's dict keeps the key)
    pool.touch(blocks[:1])
    assert len(view[1].access_history) == 1
    pool.free_blocks(blocks[:1] * 2)
    pool.get_new_blocks(1)
    assert list(view) == [1, 2, 3] and not view[1].access_history
    del view[2]
    assert list(view) == [1, 3] and view.get(2) is None and c._eviction_events == []
    view[2] = km._state(5, 9, [6, 7, 8, 9, 9])
    assert list(view) == [1, 3, 2] and list(view[2].access_history) == [7, 8, 9, 9]
    assert view.pop(3).birth_time_ns > 0 and list(view) == [1, 2]
    c.block_metrics = {3: km._state(1, 1, [])}
    assert list(c.block_metrics) == [3]
    view.clear()
    assert len(view) == 0
    # vLLM's hooks called directly act on the same state
    c.on_block_allocated(blocks[1])
    c.on_block_accessed(blocks[1])
    assert len(view[2].access_history) == 1
    c.on_block_evicted(blocks[1])
    assert len(c.drain_events()) == 1 and len(view) == 0


# -- lockstep against vLLM's own manager and collector -----------------------------------------


def _residency(c) -> tuple:
    """Sampled blocks in dict order with their access-history lengths; pending events as
    their reuse-gap counts, in order."""
    return ([(b, len(s.access_history)) for b, s in c.block_metrics.items()],
            [len(e.reuse_gaps_seconds) for e in c._eviction_events])


@pytest.mark.parametrize("rate", [1.0, 2.0, -1.0, float("nan")], ids=["1.0", "above-1", "negative", "nan"])
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("seed", range(4))
def test_lockstep_with_vllms_manager_and_collector(rate, caching, seed):
    """A shared-prefix workload (prompts from a few prefixes, so hits touch sampled blocks
    many times), in a pool small enough that allocation evicts, with connector evictions and
    resets, on vLLM's manager and collector and on kvblock's: after every call the sampled
    blocks, their histories and the events agree. Rates outside (0, 1] are set on the
    collector after construction (its constructor refuses them): vLLM's comparison
    ``random.random() < rate`` then samples every block or none, and so must kvblock."""
    rng = random.Random(seed)
    from vllm.v1.request import RequestStatus

    collectors = [KVCacheMetricsCollector(1.0), KVCacheMetricsCollector(1.0)]
    for c in collectors:
        c.sample_rate = rate
    init_none_hash(sha256)
    managers = [cls(_config(24), 64, BS, BS, enable_caching=caching, metrics_collector=c)
                for cls, c in zip((VllmKVCacheManager, kv.KVCacheManager), collectors)]
    assert type(managers[1]) is kv.KVCacheManager
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[tuple] = []
    counts = {"events": 0, "gaps": 0}
    for step in range(120):
        op = rng.random()
        if op < 0.5 or not live:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            reqs = [request(f"q{step}", prompt, BS) for _ in managers]
            results = []
            for m, r in zip(managers, reqs):
                blocks, n, _ = m.get_computed_blocks(r)
                new = m.allocate_slots(r, len(prompt) - n, n, blocks)
                if new is not None:
                    r.num_computed_tokens = len(prompt)
                    r.status = RequestStatus.RUNNING
                    m.cache_blocks(r, len(prompt))
                results.append(new is None)
            assert results[0] == results[1]
            if not results[0]:
                live.append(tuple(reqs))
        elif op < 0.85:
            pair = live.pop(rng.randrange(len(live)))
            for m, r in zip(managers, pair):
                m.free(r)
        elif op < 0.95:
            ids = {rng.randrange(1, 24) for _ in range(2)}
            for m in managers:
                m.block_pool.evict_blocks(set(ids))
        else:
            assert managers[0].reset_prefix_cache() == managers[1].reset_prefix_cache()
        sv, sk = _residency(collectors[0]), _residency(collectors[1])
        assert sv == sk, f"step {step}"
        if rng.random() < 0.2:
            ev, ek = collectors[0].drain_events(), collectors[1].drain_events()
            assert [len(e.reuse_gaps_seconds) for e in ev] == [len(e.reuse_gaps_seconds) for e in ek]
            counts["events"] += len(ek)
            counts["gaps"] += sum(1 for e in ek if e.reuse_gaps_seconds)
    if rate == 1.0 or rate == 2.0:
        assert counts["events"] > 0 or not caching
        assert counts["gaps"] > 0 or not caching
    else:
        assert counts["events"] == 0 and len(collectors[1].block_metrics) == 0


def test_vllms_own_block_pool_and_kvblocks_agree_block_by_block():
    """vLLM's ``BlockPool`` with its collector and kvblock's with another, driven alike
    through every hook (allocation, touch, eviction by allocation and by id, caching off)."""
    pools = []
    for cls in (VllmBlockPool, kv.BlockPool):
        c = KVCacheMetricsCollector(1.0)
        pools.append((cls(10, True, BS, metrics_collector=c) if cls is kv.BlockPool
                      else cls(num_gpu_blocks=10, enable_caching=True, hash_block_size=BS, metrics_collector=c), c))
    rng = random.Random(5)
    held: list[list] = [[], []]
    for step in range(300):
        op = rng.random()
        for i, (pool, c) in enumerate(pools):
            r = random.Random(step)
            if op < 0.4 and pool.get_num_free_blocks() >= 2:
                held[i].extend(pool.get_new_blocks(2))
            elif op < 0.6 and held[i]:
                pool.touch([held[i][r.randrange(len(held[i]))]])
            elif op < 0.9 and held[i]:
                pool.free_blocks([held[i].pop(r.randrange(len(held[i])))])
            else:
                pool.evict_blocks({r.randrange(1, 10)})
        assert _residency(pools[0][1]) == _residency(pools[1][1]), step


# -- sampling ----------------------------------------------------------------------------------


def test_sampling_at_a_rate_below_one_is_bernoulli():
    """At rate 0.25 every allocation is sampled with probability 0.25, independently: over
    20,000 allocations the number sampled lies within 6 standard deviations of 5,000 (seeded
    through Python's ``random``, which seeds the pool's generator when the collector binds, so
    the test is reproducible); vLLM's collector, driven alike, lands in the same band."""
    rate, blocks, rounds = 0.25, 200, 100
    sampled = {}
    for name, make in (("vllm", lambda c: VllmBlockPool(num_gpu_blocks=blocks + 1, enable_caching=True,
                                                         hash_block_size=BS, metrics_collector=c)),
                       ("kvblock", lambda c: kv.BlockPool(blocks + 1, True, BS, metrics_collector=c))):
        random.seed(1234)
        c = KVCacheMetricsCollector(rate)
        pool = make(c)
        n = 0
        for _ in range(rounds):
            got = pool.get_new_blocks(blocks)
            pool.free_blocks(got)
            n += len(c.drain_events())
        sampled[name] = n + len(c.block_metrics)  # every sampled allocation: evicted since, or held
    trials = blocks * rounds
    sd = math.sqrt(trials * rate * (1 - rate))
    for name, n in sampled.items():
        assert abs(n - trials * rate) < 6 * sd, (name, n)
    # and two samples of kvblock's from different seeds differ (it is random)
    random.seed(99)
    c = KVCacheMetricsCollector(rate)
    pool = kv.BlockPool(blocks + 1, True, BS, metrics_collector=c)
    pool.get_new_blocks(blocks)
    random.seed(100)
    c2 = KVCacheMetricsCollector(rate)
    pool2 = kv.BlockPool(blocks + 1, True, BS, metrics_collector=c2)
    pool2.get_new_blocks(blocks)
    assert list(c.block_metrics) != list(c2.block_metrics)
