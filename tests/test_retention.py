"""Beyond LRU, case by case (kvblock's own API): stale hits refused (single call and batch
admission; kvblock.vllm keeps vLLM's behaviour), probe without side effects, priority
retention and its decay on an injected clock, pinned prefixes (cap, TTL, survival), and bad
input refused with the state unchanged. The lockstep against the reference is
``test_retention_lockstep.py``."""

from __future__ import annotations

import pytest

import kvblock
from kvblock import KVCacheManager, Request
from kvblock.events import BlockStored
from kvblock.reference.manager import KVCacheManager as RefManager
from kvblock.request import RequestStatus, SamplingParams
from cli_helpers import run_cli


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _mgr(num_blocks=8, block_size=2, **kw):
    return KVCacheManager(num_blocks, block_size, **kw)


def _req(m, rid, tokens, **kw):
    return Request(rid, tokens, block_hasher=m.request_block_hasher, **kw)


def _admit(m, r):
    hits, n, _ = m.get_computed_blocks(r)
    out = m.allocate_slots(r, r.num_tokens - n, n, hits)
    assert out is not None
    r.num_computed_tokens = r.num_tokens
    r.status = RequestStatus.RUNNING
    return n


def _state(m):
    pool = m.block_pool
    n = pool.num_gpu_blocks
    return (
        list(pool.get_free_block_ids()) if hasattr(pool, "get_free_block_ids")
        else [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [pool.ref_cnt(i) for i in range(n)],
        [pool.block_hash(i) for i in range(n)],
        [pool.block_generation(i) for i in range(n)],
        [pool._retention_of(i) for i in range(n)],
        m.num_requests,
        m.pinned_prefixes,
        pool.get_num_free_blocks(),
    )


# -- stale hits ---------------------------------------------------------------------------


def _stale_setup(m):
    """Cache a 2-block prefix, look a request up on it, then let a flood evict and reuse
    every free block: the lookup's hits are stale."""
    a = _req(m, "a", [1, 2, 3, 4, 5])
    _admit(m, a)
    m.free(a)
    b = _req(m, "b", [1, 2, 3, 4, 9])
    hits, n, _ = m.get_computed_blocks(b)
    assert n == 4 and hits._ids[0].generations is not None
    flood = _req(m, "flood", list(range(100, 100 + 2 * (m.block_pool.get_num_free_blocks()))))
    assert m.allocate_slots(flood, flood.num_tokens) is not None
    return b, hits, n, flood


def test_stale_hit_raises_and_changes_nothing():
    m = _mgr(6, 2)
    b, hits, n, flood = _stale_setup(m)
    before = _state(m)
    with pytest.raises(kvblock.StaleHitError, match="evicted and reused") as e:
        m.allocate_slots(b, b.num_tokens - n, n, hits)
    assert isinstance(e.value, ValueError)
    assert _state(m) == before
    assert m.get_block_ids("b") == ([],)
    # looked up again, the request is a miss and waits for blocks; once the flood is gone
    # it is admitted and holds none of the flood's blocks
    flood_ids = set(m.get_block_ids("flood")[0])
    m.free(flood)
    hits, n, _ = m.get_computed_blocks(b)
    assert n == 0
    assert m.allocate_slots(b, b.num_tokens, n, hits) is not None
    assert m.get_block_ids("b")[0]


def test_fresh_hit_on_a_free_cached_block_is_accepted():
    """A hit block that is free but still cached (not reused) keeps its generation."""
    m = _mgr(8, 2)
    a = _req(m, "a", [1, 2, 3, 4, 5])
    _admit(m, a)
    m.free(a)
    b = _req(m, "b", [1, 2, 3, 4, 9])
    hits, n, _ = m.get_computed_blocks(b)
    other = _req(m, "c", [50, 51, 52])  # takes unhashed blocks only
    assert m.allocate_slots(other, 3) is not None
    assert m.allocate_slots(b, b.num_tokens - n, n, hits) is not None
    assert m.get_block_ids("b")[0][:2] == hits.get_block_ids()[0]


def test_evict_blocks_makes_hits_stale():
    m = _mgr(8, 2)
    a = _req(m, "a", [1, 2, 3, 4, 5])
    _admit(m, a)
    m.free(a)
    b = _req(m, "b", [1, 2, 3, 4, 9])
    hits, n, _ = m.get_computed_blocks(b)
    m.evict_blocks({hits.get_block_ids()[0][1]})
    with pytest.raises(kvblock.StaleHitError):
        m.allocate_slots(b, b.num_tokens - n, n, hits)


def test_admit_batch_hits_cannot_go_stale():
    """admit_batch looks each request up right before allocating it: the second request's
    lookup sees what the first one's allocation evicted. Same tables as the reference
    admitting them one by one (lookup, allocate), and no table holds another's block."""
    tokens = [[1, 2, 3, 4, 5], [60, 61, 62, 63, 64, 65, 66], [1, 2, 3, 4, 9]]
    m = _mgr(6, 2)
    ref = RefManager(6, 2)
    warm = _req(m, "w", [1, 2, 3, 4, 5])
    _admit(m, warm)
    m.free(warm)
    rw = Request("w", [1, 2, 3, 4, 5], block_hasher=ref.request_block_hasher)
    hits, n, _ = ref.get_computed_blocks(rw)
    ref.allocate_slots(rw, rw.num_tokens - n, n, hits)
    ref.free(rw)
    reqs = [_req(m, f"q{i}", t) for i, t in enumerate(tokens)]
    admitted, hit_tokens, *_ = m.admit_batch(reqs)
    expect = []
    for i, t in enumerate(tokens):
        r = Request(f"q{i}", t, block_hasher=ref.request_block_hasher)
        hits, n, _ = ref.get_computed_blocks(r)
        if ref.allocate_slots(r, r.num_tokens - n, n, hits) is None:
            break
        expect.append(n)
    assert admitted == len(expect) and list(hit_tokens) == expect
    tables = [m.get_block_ids(f"q{i}")[0] for i in range(admitted)]
    assert tables == [ref.get_block_ids(f"q{i}")[0] for i in range(admitted)]
    seen = [b for t in tables for b in t]
    assert len(seen) == len(set(seen))


def test_hits_built_by_hand_are_not_checked():
    """KVCacheBlocks made by the caller carry no generations: vLLM's behaviour."""
    m = _mgr(6, 2)
    b, hits, n, flood = _stale_setup(m)
    m.free(flood)
    hand = kvblock.KVCacheBlocks._from_ids(m.block_pool, (list(hits.get_block_ids()[0]),))
    assert m.allocate_slots(b, b.num_tokens - n, n, hand) is not None


def test_kvblock_vllm_keeps_vllm_behaviour_on_stale_hits():
    """kvblock.vllm takes a stale hit exactly as vLLM 0.33.0 does (no error, same tables)."""
    from conftest import require_module

    require_module("vllm")
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request as VRequest
    from vllm.sampling_params import SamplingParams as VParams

    import kvblock.vllm as kv

    init_none_hash(sha256)
    hasher = get_request_block_hasher(2, sha256)

    def config():
        spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype=torch.float32)
        return KVCacheConfig(num_blocks=6, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])

    def vreq(rid, toks):
        p = VParams(max_tokens=4)
        p.update_from_generation_config({}, 2)
        return VRequest(request_id=rid, prompt_token_ids=toks, sampling_params=p, pooling_params=None,
                        block_hasher=hasher)

    outs = []
    for cls in (VllmManager, kv.KVCacheManager):
        m = cls(config(), 64, 2, 2, enable_caching=True)
        a = vreq("a", [1, 2, 3, 4, 5])
        hits, n = m.get_computed_blocks(a)[:2]
        m.allocate_slots(a, a.num_tokens - n, n, hits)
        m.free(a)
        b = vreq("b", [1, 2, 3, 4, 9])
        hits, n = m.get_computed_blocks(b)[:2]
        flood = vreq("f", list(range(100, 110)))
        m.allocate_slots(flood, flood.num_tokens)
        m.free(flood)
        res = m.allocate_slots(b, b.num_tokens - n, n, hits)
        outs.append((n, None if res is None else res.get_block_ids(), m.get_block_ids("b")))
    assert outs[0] == outs[1]


# -- probe --------------------------------------------------------------------------------


def test_probe_touches_nothing():
    m = _mgr(8, 2, log_stats=True, enable_kv_cache_events=True)
    a = _req(m, "a", [1, 2, 3, 4, 5, 6, 7])
    _admit(m, a)
    m.free(a)
    m.take_events()
    full = SamplingParams(max_tokens=1, extra_args={"kv_cache_report_mode": "full"})
    b = _req(m, "b", [1, 2, 3, 4, 5, 9], sampling_params=full)
    before = (_state(m), m.make_prefix_cache_stats(), m.block_pool.get_num_free_blocks())
    m.prefix_cache_stats = before[1]  # put the stats object back: make_ swapped it
    assert m.probe(b) == 4
    assert m.probe(b, max_cache_hit_length=2) == 2
    assert (_state(m), m.prefix_cache_stats, m.block_pool.get_num_free_blocks()) == before
    assert m.take_events() == []
    # get_computed_blocks, by contrast, reports the "full" hit
    assert m.get_computed_blocks(b)[1] == 4
    assert any(isinstance(e, BlockStored) for e in m.take_events())
    assert m.probe(_req(m, "c", [9, 9, 9])) == 0


# -- priority retention --------------------------------------------------------------------


def _cache(m, rid, tokens, **kw):
    r = _req(m, rid, tokens, **kw)
    _admit(m, r)
    m.free(r)
    return r


def test_lowest_priority_is_evicted_first_then_lru():
    clock = Clock()
    m = _mgr(7, 2, priority_retention=True, clock=clock)
    _cache(m, "hi", [1, 2, 3, 4], retention=[(0, 4, 90, None)])
    _cache(m, "lo", [5, 6, 7, 8], retention_priority=10)
    _cache(m, "mid", [9, 10, 11, 12])
    pool = m.block_pool
    prios = {b: pool._retention_of(b)[1] for b in range(1, 7)}
    assert sorted(prios.values()) == [10, 10, 35, 35, 90, 90]
    order = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert [prios[b] for b in order] == [10, 10, 35, 35, 90, 90]
    # a 2-block request evicts the low-priority prefix; the others still hit
    x = _req(m, "x", [40, 41, 42, 43])
    assert m.allocate_slots(x, 4) is not None
    assert m.probe(_req(m, "p1", [5, 6, 7, 8, 0])) == 0
    assert m.probe(_req(m, "p2", [1, 2, 3, 4, 0])) == 4
    assert m.probe(_req(m, "p3", [9, 10, 11, 12, 0])) == 4


def test_priority_decays_after_its_duration():
    clock = Clock(1000.0)
    m = _mgr(5, 2, priority_retention=True, clock=clock, decay_granularity_s=1.0)
    _cache(m, "hi", [1, 2, 3, 4], retention=[(0, 4, 90, 5.0)])
    clock.t = 1001.0
    _cache(m, "mid", [9, 10, 11, 12])
    pool = m.block_pool
    hi_blocks = [b for b in range(1, 5) if pool._retention_of(b)[0] == 90]
    assert len(hi_blocks) == 2
    clock.t = 1004.9
    m.tick()
    assert all(pool._retention_of(b)[1] == 90 for b in hi_blocks)
    clock.t = 1005.0  # ceil((1000 + 5) / 1) = bucket 1005
    m.tick()
    assert all(pool._retention_of(b)[1] == 35 for b in hi_blocks)
    # decayed blocks joined the default level's tail: the older default blocks go first
    order = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert order[-2:] == sorted(hi_blocks, key=order.index) and set(order[-2:]) == set(hi_blocks)
    x = _req(m, "x", [40, 41, 42, 43])
    assert m.allocate_slots(x, 4) is not None
    assert m.probe(_req(m, "p", [1, 2, 3, 4, 0])) == 4
    assert m.probe(_req(m, "q", [9, 10, 11, 12, 0])) == 0


def test_shared_block_keeps_the_highest_priority():
    clock = Clock()
    m = _mgr(8, 2, priority_retention=True, clock=clock)
    a = _req(m, "a", [1, 2, 3, 4, 5], retention=[(0, 4, 80, None)])
    _admit(m, a)
    b = _req(m, "b", [1, 2, 3, 4, 6], retention_priority=5)
    _admit(m, b)
    shared = m.get_block_ids("a")[0][:2]
    m.free(b)
    m.free(a)
    assert [m.block_pool._retention_of(x)[1] for x in shared] == [80, 80]


def test_policies_off_ignore_request_retention():
    """Without priority_retention the free queue is vLLM's, whatever requests ask for."""
    plain, asked = _mgr(8, 2), _mgr(8, 2)
    for m, kw in ((plain, {}), (asked, {"retention": [(0, 4, 100, None)], "retention_priority": 0})):
        _cache(m, "a", [1, 2, 3, 4, 5], **kw)
        _cache(m, "b", [6, 7, 8, 9, 10])
    assert _state(plain) == _state(asked)
    assert plain.block_pool._retention_of(1) is None


# -- pins -----------------------------------------------------------------------------------


def test_pin_survives_requests_and_eviction_pressure():
    m = _mgr(6, 2, max_pinned_fraction=0.5)
    system = [1, 2, 3, 4]
    _cache(m, "a", system + [5])
    assert m.pin_prefix(system) == 4
    assert m.num_pinned_blocks == 2 and m.block_pool.get_num_free_blocks() == 3
    flood = _req(m, "f", list(range(100, 106)))
    assert m.allocate_slots(flood, 6) is not None  # every free block
    assert m.allocate_slots(_req(m, "g", [7, 7]), 2) is None  # pinned blocks are not free
    m.free(flood)
    assert m.probe(_req(m, "b", system + [9])) == 4
    assert m.unpin_prefix(system) == 4
    assert m.num_pinned_blocks == 0 and m.block_pool.get_num_free_blocks() == 5


def test_pin_by_block_hashes_and_repin():
    clock = Clock()
    m = _mgr(10, 2, max_pinned_fraction=1.0, clock=clock)
    a = _cache(m, "a", [1, 2, 3, 4, 5, 6, 7])
    hashes = list(a.block_hashes[:2])
    assert m.pin_prefix(hashes, ttl_s=10) == 4
    (key, toks, ids, exp), = m.pinned_prefixes
    assert key == hashes[-1] and toks == 4 and exp == 1010.0
    clock.t = 1005
    assert m.pin_prefix([1, 2, 3, 4]) == 4  # same prefix by tokens: re-pinned, no TTL now
    assert m.pinned_prefixes[0][3] is None and m.num_pinned_blocks == 2
    assert [m.block_pool.ref_cnt(b) for b in ids] == [1, 1]


def test_pin_ttl_expires():
    clock = Clock()
    m = _mgr(6, 2, max_pinned_fraction=1.0, clock=clock)
    _cache(m, "a", [1, 2, 3, 4, 5])
    assert m.pin_prefix([1, 2, 3, 4], ttl_s=300) == 4
    clock.t += 299.9
    m.tick()
    assert m.num_pinned_blocks == 2
    clock.t += 0.1
    m.tick()
    assert m.num_pinned_blocks == 0 and m.pinned_prefixes == []
    assert m.block_pool.get_num_free_blocks() == 5
    with pytest.raises(ValueError, match="not pinned"):
        m.unpin_prefix([1, 2, 3, 4])


def test_pin_nothing_cached_pins_nothing():
    m = _mgr(6, 2)
    assert m.pin_prefix([1, 2, 3, 4]) == 0
    assert m.pinned_prefixes == []


# -- bad input --------------------------------------------------------------------------------


BAD_RETENTION = pytest.mark.parametrize(
    "kw, exc",
    [
        ({"retention": [(0, 4, 101, None)]}, ValueError),
        ({"retention": [(0, 4, -1, None)]}, ValueError),
        ({"retention": [(0, 4, 50, -1.0)]}, ValueError),
        ({"retention": [(0, 4, 50, float("nan"))]}, ValueError),
        ({"retention": [(0, 6, 50, None)]}, ValueError),  # past the 5-token prompt
        ({"retention": [(3, 3, 50, None)]}, ValueError),  # empty
        ({"retention": [(-1, 3, 50, None)]}, ValueError),
        ({"retention": [(0, 3, 50)]}, ValueError),
        ({"retention": [(0, 3, True, None)]}, TypeError),
        ({"retention": "0-3"}, TypeError),
        ({"retention_priority": 101}, ValueError),
        ({"retention_priority": -1}, ValueError),
        ({"retention_priority": "high"}, TypeError),
    ],
)


@BAD_RETENTION
def test_bad_retention_is_refused_when_the_request_is_built(kw, exc):
    """It used to pass Request(...) and fail only at the first allocate_slots (issue 34)."""
    with pytest.raises(exc, match="request.retention"):
        Request("b", [1, 2, 3, 4, 9], **kw)


@BAD_RETENTION
def test_bad_retention_set_later_is_refused_with_state_unchanged(kw, exc):
    m = _mgr(8, 2, priority_retention=True, clock=Clock())
    _cache(m, "a", [1, 2, 3, 4, 5])
    r = _req(m, "b", [1, 2, 3, 4, 9])
    for name, value in kw.items():
        setattr(r, name, value)
    hits, n, _ = m.get_computed_blocks(r)
    before = _state(m)
    with pytest.raises(exc):
        m.allocate_slots(r, r.num_tokens - n, n, hits)
    assert _state(m) == before
    with pytest.raises(exc):
        m.admit_batch([r])
    assert _state(m) == before


def test_bad_pins_are_refused_with_state_unchanged():
    clock = Clock()
    m = _mgr(9, 2, max_pinned_fraction=0.25, clock=clock)  # cap: 2 blocks
    _cache(m, "a", [1, 2, 3, 4, 5, 6, 7])
    before = _state(m)
    for call, exc in (
        (lambda: m.pin_prefix([1, 2, 3, 4, 5, 6]), ValueError),  # 3 blocks > cap
        (lambda: m.pin_prefix([1, 2, 3, 4], ttl_s=-1), ValueError),
        (lambda: m.pin_prefix([1, 2, 3, 4], ttl_s=float("inf")), ValueError),
        (lambda: m.pin_prefix([1]), ValueError),  # no full block
        (lambda: m.unpin_prefix([1, 2, 3, 4]), ValueError),  # not pinned
        (lambda: m.pin_prefix([b"x" * 32, 3]), TypeError),
    ):
        with pytest.raises(exc):
            call()
        assert _state(m) == before
    assert m.pin_prefix([1, 2, 3, 4]) == 4
    pinned = _state(m)
    with pytest.raises(ValueError, match="cap"):
        m.pin_prefix([1, 2, 3, 4, 5, 6])
    assert _state(m) == pinned


@pytest.mark.parametrize(
    "kw",
    [
        {"default_retention_priority": 101},
        {"default_retention_priority": -1},
        {"decay_granularity_s": 0.0},
        {"decay_granularity_s": -1.0},
        {"max_pinned_fraction": 1.5},
        {"max_pinned_fraction": -0.1},
    ],
)
def test_bad_constructor_arguments(kw):
    with pytest.raises(ValueError):
        _mgr(8, 2, priority_retention=True, **kw)


def test_clock_must_be_callable():
    with pytest.raises(TypeError):
        _mgr(8, 2, clock=5)


# -- the replay CLI -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["priority", "pin-system-prompts", "ttl"])
def test_replay_retention_kvblock_and_reference_agree(capsys, policy):
    """A scheduled replay with each policy: kvblock and the reference give identical results
    (hits, evictions, preemptions, block ids per step)."""
    import json

    code, out, _ = run_cli(capsys, "replay", "--workload", "chat", "--limit", "60", "--num-blocks", "600",
                        "--retention", policy, "--pin-tokens", "1024", "--ttl-s", "20", "--compare", "--json",
                        "--no-progress")
    assert code == 0
    assert json.loads(out)["identical"] is True


def test_replay_retention_changes_hits_and_lru_is_vllm(capsys):
    import json

    rates = {}
    for policy in ("lru", "priority"):
        code, out, _ = run_cli(capsys, "replay", "--workload", "chat", "--ideal", "--num-blocks", "1000",
                            "--retention", policy, "--json", "--no-progress", "--fingerprint")
        assert code == 0
        d = json.loads(out)
        rates[policy] = (d["prefix_cache"]["hits"], d["fingerprint"])
    code, out, _ = run_cli(capsys, "replay", "--workload", "chat", "--ideal", "--num-blocks", "1000", "--json",
                        "--no-progress", "--fingerprint")
    d = json.loads(out)
    assert (d["prefix_cache"]["hits"], d["fingerprint"]) == rates["lru"]  # --retention lru is the default
    assert "retention" not in d["config"]
    assert rates["priority"][0] != rates["lru"][0]


@pytest.mark.parametrize("argv", [
    ["replay", "--workload", "chat", "--retention", "mru"],
    ["replay", "--workload", "chat", "--retention", "ttl", "--ttl-s", "0"],
    ["replay", "--workload", "chat", "--retention", "pin-system-prompts", "--pin-tokens", "3"],
    ["sweep", "builtin:chat", "--retention", "lru,mru"],
])
def test_replay_retention_bad_options(capsys, argv):
    code, _, err = run_cli(capsys, *argv, "--no-progress")
    assert code == 2 and err.strip()


def test_sweep_one_series_per_policy(capsys):
    import json

    code, out, _ = run_cli(capsys, "sweep", "builtin:chat", "--capacities", "500,2k", "--retention",
                        "lru,priority", "--json", "--no-progress")
    assert code == 0
    names = [s["name"] for s in json.loads(out)["series"]]
    assert names == ["chat", "chat (priority)"]


def test_many_ttl_pins_expire_in_order_like_the_reference():
    """2,000 TTL pins (expiry is a min-heap with lazy deletion): some re-pinned with another
    TTL or none, some unpinned by hand, the clock moved in steps. After every step both
    managers hold exactly the pins a plain model says are alive, and their free queues (the
    order expired pins released their blocks in: earliest expiry first) are the same."""
    import random

    rng = random.Random(3)
    n = 2000
    clock = Clock(0.0)
    fast = _mgr(2 * n + 8, 1, max_pinned_fraction=1.0, clock=clock)
    ref = RefManager(2 * n + 8, 1, max_pinned_fraction=1.0, clock=clock)
    prompts = [[10_000 + i, 1] for i in range(n)]
    for i, p in enumerate(prompts):
        for m in (fast, ref):
            _cache(m, f"r{i}", p)
    model: dict[int, float | None] = {}

    def pin(i, ttl):
        key = [prompts[i][0]]
        hashes = _req(fast, "h", key).block_hashes
        assert fast.pin_prefix(key, ttl_s=ttl) == ref.pin_prefix(hashes, ttl) == 1
        model[i] = None if ttl is None else clock.t + ttl

    for i in range(n):
        pin(i, rng.choice([None, rng.uniform(0, 100), float(rng.randrange(0, 100, 10))]))
    for step in range(40):
        for i in rng.sample(range(n), 60):
            if i in model and rng.random() < 0.3:
                hashes = _req(fast, "h", [prompts[i][0]]).block_hashes
                assert fast.unpin_prefix([prompts[i][0]]) == ref.unpin_prefix(hashes) == 1
                del model[i]
            else:
                pin(i, rng.choice([None, rng.uniform(0, 50), 5.0]))
        clock.t += rng.choice([0.0, 0.5, 2.5, 10.0])
        fast.tick()
        ref.tick()
        model = {i: e for i, e in model.items() if e is None or e > clock.t}
        alive = sorted(_req(fast, "h", [prompts[i][0]]).block_hashes[0] for i in model)
        assert [k for k, _, _, _ in fast.pinned_prefixes] == alive
        assert sorted(ref.pins) == alive
        assert fast.num_pinned_blocks == ref.num_pinned_blocks == len(model)
        queue = lambda m: [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]  # noqa: E731
        assert queue(fast) == queue(ref)
    clock.t += 1000.0
    fast.tick()
    ref.tick()
    assert fast.num_pinned_blocks == ref.num_pinned_blocks == sum(e is None for e in model.values())
