"""kvblock's manager holding HiSparse groups (the Rust core's ``manager::coordinator_hisparse``:
the host pool and the residency in the manager) against vLLM's own ``KVCacheManager`` bound to
its ``HiSparseCoordinator``, in lockstep, driven as vLLM's HiSparse connector drives it.

vLLM's side is built as vLLM's HiSparse tests build it (``make_hisparse_kv_cache_config``'s
layout: source group on the host pool, indexer, resident, hot with two blocks per request,
then ``get_hisparse_coordinator``). kvblock's side is ``kvblock.vllm.KVCacheManager`` (a
HiSparse configuration goes to kvblock's manager, with its views). A hypothesis state machine admits
requests (new prompts and external imports, with and without the full-sequence admission
gate), runs decode steps and frees requests (finished or preempted), and makes the
connector's coordinator calls (``advance_scheduled``, ``update_residency``,
``build_offload_command``, ``update_spills`` as every worker completes) and the calls vLLM's
tests make on the views (the hot groups' ``require_hot``, assigning ``max_spill_pages``,
``take_residency_updates``, ``all_context_pages_resident``, ``build_row_mirrors``):
kvblock's through its coordinator view (``get_hisparse_coordinator(manager)``, over the manager
binding's ``_hisparse_*`` calls), so a view that keeps a change to itself fails here. After
every step both managers hold the same block ids in every group (host ids for the source
group), the same block objects in ``get_blocks`` (the source group's from the host pool: same
ref counts), the same residency rows, hot requirements and spill budget, and both pools have
the same free blocks; released pages reused inside ``allocate_slots`` are lost at once on both
sides. Host-prefix hits are not driven here (``tests/test_vllm_hisparse_lockstep.py`` covers
them through the ``_core.HiSparseResidency`` harness).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from conftest import require_module
from fresh_interpreter import run_alone

require_module("vllm")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

hisparse = pytest.importorskip("vllm.v1.hisparse.coordinator")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_manager as _vkm  # noqa: E402
from vllm.v1.core import kv_cache_utils as _vku  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvblock.vllm.config import translate  # noqa: E402
from kvblock.vllm.hisparse import HiSparseCoordinatorView  # noqa: E402
from kvblock.vllm.manager import KVCacheManager as KvblockManager  # noqa: E402
from kvblock.vllm.originals import original  # noqa: E402

VllmManager = original(_vkm, "KVCacheManager")
get_request_block_hasher = original(_vku, "get_request_block_hasher")
init_none_hash = original(_vku, "init_none_hash")
EXAMPLES = int(os.environ.get("KVBLOCK_LOCKSTEP_EXAMPLES", "60"))
BS = 16
REQUESTS = ["r0", "r1", "r2", "r3"]
#: What the run reached (checked by ``test_hisparse_manager_lockstep``).
COVERAGE: Counter[str] = Counter()


def _config(num_blocks: int, host_num_blocks: int | None) -> KVCacheConfig:
    source = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["source"], source, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        KVCacheGroupSpec(["indexer"], source, role=KVCacheGroupRole.HISPARSE_INDEXER),
        KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BS, page_size=BS * 4)),
        KVCacheGroupSpec(["hot"], HiSparseHotSpec(block_size=BS, page_size=BS * 4, blocks_per_request=2)),
    ]
    return KVCacheConfig(
        num_blocks=num_blocks, hisparse_host_num_blocks=host_num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )


def test_a_hisparse_configuration_is_translated_to_kvblock_s_manager():
    path = translate(_config(32, 16))
    assert path.on_kvblock and path.hisparse_host_num_blocks == 16
    assert [g["kind"] for g in path.groups] == ["hisparse_source", "full_attention", "hisparse_resident", "hisparse_hot"]
    assert path.groups[3]["blocks_per_request"] == 2
    assert [g["prefix_cacheable"] for g in path.groups] == [True, True, False, False]
    # the source and the indexer share a spec but not a manager class: separate lookups
    assert path.groups[0]["spec_class"] != path.groups[1]["spec_class"]


def test_hisparse_roles_without_host_capacity_fall_back():
    path = translate(_config(32, None))
    assert not path.on_kvblock and "role" in path.reason


def test_vllm_hisparse_errors_are_vllm_s_and_build_nothing():
    cfg = _config(32, 16)
    cfg.kv_cache_groups[0], cfg.kv_cache_groups[2] = cfg.kv_cache_groups[2], cfg.kv_cache_groups[0]
    with pytest.raises(ValueError, match="HiSparse host group must precede resident groups."):
        KvblockManager(cfg, max_model_len=128, scheduler_block_size=BS, hash_block_size=BS, enable_caching=False)
    # vLLM raises it when its coordinator binds the groups
    vm = VllmManager(cfg, max_model_len=128, scheduler_block_size=BS, hash_block_size=BS, enable_caching=False)
    with pytest.raises(ValueError, match="HiSparse host group must precede resident groups."):
        hisparse.get_hisparse_coordinator(vm)


class HiSparseManagerLockstep(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(12, 48),
        host_num_blocks=st.integers(6, 32),
        max_in_flight_tokens=st.sampled_from([None, 32, 48]),
        caching=st.booleans(),
        events=st.booleans(),
    )
    def setup(self, num_blocks: int, host_num_blocks: int, max_in_flight_tokens, caching: bool, events: bool) -> None:
        args = dict(
            max_model_len=128,
            scheduler_block_size=BS,
            hash_block_size=BS,
            max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=caching,
            enable_kv_cache_events=events,
        )
        self.vm = VllmManager(_config(num_blocks, host_num_blocks), **args)
        self.vc = hisparse.get_hisparse_coordinator(self.vm)
        self.km = KvblockManager(_config(num_blocks, host_num_blocks), **args)
        assert type(self.km).__module__.startswith("kvblock"), "kvblock's manager must hold the HiSparse groups"
        # kvblock's side is driven through the views vLLM's connector and tests read (the
        # coordinator view over the manager binding's _hisparse_* calls)
        self.kc = hisparse.get_hisparse_coordinator(self.km)
        assert isinstance(self.kc, HiSparseCoordinatorView)
        self.requests: dict[str, Request] = {}
        self.sent: list[int] = []
        self.outsiders: list[tuple[list, list]] = []
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)

    def _both(self, call: str, *args, **kwargs):
        outs = []
        for m in (self.vm, self.km):
            try:
                outs.append(("ok", getattr(m, call)(*args, **kwargs)))
            except (AssertionError, ValueError) as e:
                outs.append((type(e).__name__, None))
        (vk, v), (kk, k) = outs
        assert vk == kk, (call, outs)
        if v is None or k is None:
            assert v is None and k is None, (call, v, k)
            return None
        return v.get_block_ids(), k.get_block_ids()

    @rule(
        request=st.sampled_from(REQUESTS),
        prompt=st.integers(1, 100),
        external=st.one_of(st.just(0), st.just(0), st.integers(1, 64)),
        must_fit=st.booleans(),
    )
    def admit(self, request: str, prompt: int, external: int, must_fit: bool) -> None:
        if request in self.requests:
            return
        req = Request(request, list(range(prompt)), SamplingParams(max_tokens=8), None, block_hasher=self.hasher)
        external = min(external, prompt - 1)
        out = self._both(
            "allocate_slots",
            req,
            prompt - external,
            num_external_computed_tokens=external,
            full_sequence_must_fit=must_fit,
        )
        if out is not None:
            v, k = out
            assert [list(g) for g in v] == [list(g) for g in k], (v, k)
            req.num_computed_tokens = prompt
            self.requests[request] = req
            COVERAGE["import"] += external > 0
            COVERAGE["hot region"] += bool(k[3])
        else:
            COVERAGE["refused"] += 1

    @rule(request=st.sampled_from(REQUESTS), n=st.integers(1, 20))
    def decode(self, request: str, n: int) -> None:
        req = self.requests.get(request)
        if req is None or req.num_tokens + n > 128:
            return
        for _ in range(n):
            req.append_output_token_ids(7)
        out = self._both("allocate_slots", req, n)
        if out is not None:
            v, k = out
            assert [list(g) for g in v] == [list(g) for g in k], (v, k)
            req.num_computed_tokens = req.num_tokens
        # refused: the tokens stay, uncomputed, as with vLLM's scheduler

    @rule(request=st.sampled_from(REQUESTS), finished=st.booleans())
    def free(self, request: str, finished: bool) -> None:
        req = self.requests.pop(request, None)
        if req is None:
            return
        req.status = RequestStatus.FINISHED_STOPPED if finished else RequestStatus.PREEMPTED
        self.vm.free(req)
        self.km.free(req)
        COVERAGE["freed"] += 1

    @rule(request=st.sampled_from(REQUESTS))
    def advance_scheduled(self, request: str) -> None:
        req = self.requests.get(request)
        if req is None:
            return
        self.vc.advance_scheduled([(request, req.num_computed_tokens)])
        self.kc.advance_scheduled([(request, req.num_computed_tokens)])

    @rule(request=st.sampled_from(REQUESTS))
    def update_residency(self, request: str) -> None:
        if request not in self.requests:
            return
        self.vc.update_residency(request)
        self.kc.update_residency(request)

    @rule()
    def offload_command(self) -> None:
        cmd = self.vc.build_offload_command()
        theirs = list(cmd.page_transfers) if cmd is not None else []
        ours_cmd = self.kc.build_offload_command()
        ours = list(ours_cmd.page_transfers) if ours_cmd is not None else []
        # vLLM's own SparseKVPageTransfer on both sides (after_forward included where it exists)
        assert ours == theirs, (ours, theirs)
        self.sent.extend(t.transfer_id for t in theirs)
        COVERAGE["spills"] += bool(theirs)

    @rule()
    def every_worker_done(self) -> None:
        if not self.sent:
            return
        counts = {i: 1 for i in self.sent}
        self.vc.update_spills(counts, counts)
        self.kc.update_spills(counts, counts)
        self.sent = []

    @rule(n=st.integers(1, 8), all_free=st.booleans())
    def other_allocations(self, n: int, all_free: bool) -> None:
        # vLLM code outside the manager (a connector) takes device blocks from the pool: released
        # pages at the queue's tail are reused; vLLM's watcher fires at once, kvblock's manager
        # drains it at its next call (the invariant's reads are such calls)
        free = self.vm.block_pool.get_num_free_blocks()
        n = free if all_free else n
        if n == 0 or n > free:
            return
        theirs = self.vm.block_pool.get_new_blocks(n)
        ours = self.km.block_pool.get_new_blocks(n)
        assert [b.block_id for b in theirs] == [b.block_id for b in ours]
        self.outsiders.append((theirs, ours))
        COVERAGE["other allocations"] += 1

    @rule()
    def release_others(self) -> None:
        if self.outsiders:
            theirs, ours = self.outsiders.pop(0)
            self.vm.block_pool.free_blocks(theirs)
            self.km.block_pool.free_blocks(ours)

    @rule(request=st.sampled_from(REQUESTS))
    def require_hot(self, request: str) -> None:
        # vLLM's connector and tests ask the hot groups directly (HiSparseHotManager.require_hot);
        # on kvblock's view that is a real call, not an add to a snapshot of hot_required
        if request not in self.requests:
            return
        for c in (self.vc, self.kc):
            for hot in c.hot_managers:
                hot.require_hot(request)
        COVERAGE["require_hot"] += 1

    @rule(n=st.sampled_from([1, 2, 8]))
    def spill_budget(self, n: int) -> None:
        # vLLM's tests lower the coordinator's plain attribute; kvblock's view sets the Rust one
        self.vc.max_spill_pages = n
        self.kc.max_spill_pages = n
        COVERAGE["spill budget"] += n < 8

    @rule(requests=st.lists(st.sampled_from(REQUESTS), min_size=1, max_size=3, unique=True))
    def residency_updates(self, requests: list[str]) -> None:
        # the worker's residency updates (stale pages, then pages appended since the last one)
        live = [r for r in requests if r in self.requests]
        if not live:
            return
        v = self.vc.take_residency_updates(live)
        k = self.kc.take_residency_updates(live)
        assert {r: (u.pages, [list(g) for g in u.block_ids]) for r, u in v.items()} == {
            r: (u.pages, [list(g) for g in u.block_ids]) for r, u in k.items()
        }
        COVERAGE["residency updates"] += bool(v)

    @rule()
    def scheduled_reads(self) -> None:
        # the step's reads: every live request's last token scheduled
        rows = [(r, req.num_computed_tokens - 1, 1) for r, req in sorted(self.requests.items())]
        if not rows:
            return
        assert self.vc.all_context_pages_resident(rows) == self.kc.all_context_pages_resident(rows)
        assert self.vc.build_row_mirrors(rows) == self.kc.build_row_mirrors(rows)
        COVERAGE["not all resident"] += not self.vc.all_context_pages_resident(rows)

    @rule()
    def connector_step(self) -> None:
        # one scheduler step's connector work: every live request advanced, the offload
        # command built and every spill completed by the one worker
        for request in sorted(self.requests):
            self.advance_scheduled(request)
        self.offload_command()
        self.every_worker_done()

    @invariant()
    def same_tables_and_pools(self) -> None:
        if not hasattr(self, "km"):
            return
        for r in self.requests:
            v = [list(g) for g in self.vm.get_block_ids(r)]
            k = [list(g) for g in self.km.get_block_ids(r)]
            assert v == k, (r, v, k)
        assert self.vm.block_pool.get_num_free_blocks() == self.km.block_pool.get_num_free_blocks()
        assert self.vc.host_manager.block_pool.get_num_free_blocks() == self.km._hisparse_host_free_blocks
        vres = self.vc.resident_managers[0]
        for r in self.requests:
            assert [b.block_id for b in vres.get_residency_row(r)] == self.km._hisparse_residency_row(0, r), r
        kres = self.kc.resident_managers[0]
        assert {r: {p: b.block_id for p, b in c.items()} for r, c in vres.residency_changes.items()} == {
            r: {p: b.block_id for p, b in c.items()} for r, c in kres.residency_changes.items()
        }
        hot = sorted(self.vc.hot_managers[0].hot_required)
        assert hot == self.km._hisparse_hot_required(0)
        COVERAGE["hot required"] += bool(hot)
        COVERAGE["host-only pages"] += any(0 in self.km._hisparse_residency_row(0, r) for r in self.requests)
        assert self.vc.has_pending_work() == self.km._hisparse_has_pending_work()
        assert (self.kc.max_spill_pages, self.kc.transition_watermark) == (
            self.vc.max_spill_pages,
            self.vc.transition_watermark,
        )
        # the block objects of get_blocks (KVCacheBlocks.blocks): the source group's are host
        # blocks, so their ref counts and keys are the host pool's, as vLLM's (the null block's
        # count is not compared: 0.32 frees its untrimmed resident row's null head, going below 0)
        def seen(blocks):
            return [[(b.block_id, None if b.is_null else b.ref_cnt, b.block_hash is None) for b in g] for g in blocks]

        for r in self.requests:
            assert seen(self.vm.get_blocks(r).blocks) == seen(self.km.get_blocks(r).blocks), r
        # KV events: the host pool's (medium CPU) share the device pool's queue, in order
        v_events, k_events = self.vm.take_events(), self.km.take_events()
        assert v_events == k_events
        COVERAGE["host events"] += any(getattr(e, "medium", None) == "CPU" for e in k_events)


def test_hisparse_manager_lockstep():
    # in an interpreter of its own, so that its examples (and its coverage check) do not
    # depend on what ran before in the process (see tests/fresh_interpreter.py)
    if run_alone(__file__, "test_hisparse_manager_lockstep"):
        return
    HiSparseManagerLockstep.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        # the same examples every run, so that the coverage check below cannot flake
        derandomize=True,
        database=None,
    )
    HiSparseManagerLockstep.TestCase().runTest()
    assert all(
        COVERAGE[k]
        for k in (
            "import", "hot region", "refused", "freed", "spills", "hot required", "host-only pages", "other allocations",
            "require_hot", "spill budget", "residency updates", "not all resident",
        )
    ), COVERAGE


def test_a_released_page_reused_by_other_code_is_lost_on_both_sides():
    # a request that filled its admission window gets a hot region, reads from the host, and
    # releases its clean sealed pages (unpin_blocks); vLLM code outside the manager then takes
    # every free device block: kvblock's manager loses those pages at its next call, as
    # vLLM's watcher does at once
    m = HiSparseManagerLockstep()
    m.setup(num_blocks=32, host_num_blocks=32, max_in_flight_tokens=32, caching=False, events=False)
    m.admit(request="r0", prompt=64, external=0, must_fit=False)
    m.connector_step()  # pages 0-2 spill; 4 resident pages fill the window of 2: hot required
    m.same_tables_and_pools()
    m.decode(request="r0", n=1)  # the hot region
    m.connector_step()  # clean pages 0-2 released (3 and 4 are the active tail)
    m.same_tables_and_pools()
    table = list(m.km.get_block_ids("r0")[2])
    assert m.km._hisparse_residency_row(0, "r0") == table
    released = [i for i, b in enumerate(table) if m.km.block_pool.blocks[b].ref_cnt == 0]
    assert released == [0, 1, 2]
    m.other_allocations(n=0, all_free=True)
    m.same_tables_and_pools()
    assert m.km._hisparse_residency_row(0, "r0") == [0 if i in released else b for i, b in enumerate(table)]


def _same_record(ours, theirs) -> None:
    import copy
    import pickle

    assert type(ours) is type(theirs) and ours == theirs and hash(ours) == hash(theirs) and repr(ours) == repr(theirs)
    assert pickle.loads(pickle.dumps(ours)) == theirs and copy.deepcopy(ours) == theirs
    name = next(iter(vars(theirs)))
    with pytest.raises(AttributeError):
        setattr(ours, name, None)  # still frozen


def test_connector_calls_return_vllm_s_objects():
    # the connector's per-step calls go straight to the core, which builds vLLM's own frozen
    # dataclasses (SparseKVRowMirror, SparseKVPageTransfer in a SparseKVOffloadCommand,
    # SparseKVResidencyUpdate): equal, hashed, printed, pickled and copied as vLLM's, from
    # any iterable (a generator here) or mapping vLLM's connector passes
    m = HiSparseManagerLockstep()
    m.setup(num_blocks=32, host_num_blocks=32, max_in_flight_tokens=None, caching=False, events=False)
    m.admit(request="r0", prompt=64, external=48, must_fit=False)  # pages 0-1 host-only, 2-3 resident
    m.admit(request="r1", prompt=40, external=0, must_fit=False)
    rows = [("r0", 64, 1), ("r1", 40, 1)]
    theirs, ours = m.vc.build_row_mirrors(rows), m.kc.build_row_mirrors(r for r in rows)
    assert type(ours) is tuple and len(ours) == len(theirs) >= 1
    for a, b in zip(ours, theirs):
        _same_record(a, b)
    assert m.kc.all_context_pages_resident(r for r in rows) is m.vc.all_context_pages_resident(rows)
    steps = [("r0", 64), ("r1", 40)]
    m.vc.advance_scheduled(steps)
    m.kc.advance_scheduled(s for s in steps)
    theirs, ours = m.vc.build_offload_command(), m.kc.build_offload_command()
    assert type(ours) is type(theirs) and len(ours.page_transfers) == len(theirs.page_transfers) >= 1
    for a, b in zip(ours.page_transfers, theirs.page_transfers):
        _same_record(a, b)
    assert type(ours.page_transfers) is type(theirs.page_transfers)
    counts = {t.transfer_id: 1 for t in theirs.page_transfers}
    m.vc.update_spills(counts, counts)
    m.kc.update_spills(counts, counts)
    m.same_tables_and_pools()
    assert m.kc.request_states == m.vc.request_states
    updates_v = m.vc.take_residency_updates(["r0", "r1"])
    updates_k = m.kc.take_residency_updates(r for r in ["r0", "r1"])
    assert list(updates_k) == list(updates_v)
    for rid in updates_v:
        assert type(updates_k[rid]) is type(updates_v[rid]) and updates_k[rid] == updates_v[rid]
    # bad input, as vLLM's body meets it (a non-int count: TypeError; a short row: ValueError,
    # as unpacking it): nothing changed
    with pytest.raises(TypeError):
        m.kc.build_row_mirrors([("r0", "x", 1)])
    with pytest.raises(TypeError):
        m.kc.update_spills({"x": 1}, {})
    with pytest.raises(ValueError):
        m.kc.advance_scheduled([("r0",)])
    assert m.kc.request_states == m.vc.request_states


def test_resident_page_calls_on_the_views_are_vllm_s():
    # the resident groups' drop_resident_page / adopt_resident_page and the coordinator's
    # commit_computed_blocks, called on the views as on vLLM's managers: the same overlay
    # (residency_changes, also a dropped adopted page's null entry) and rows on both sides
    m = HiSparseManagerLockstep()
    m.setup(num_blocks=32, host_num_blocks=32, max_in_flight_tokens=None, caching=False, events=False)
    m.admit(request="r0", prompt=64, external=48, must_fit=False)  # pages 0-1 host-only, 2-3 resident
    m.admit(request="r1", prompt=16, external=0, must_fit=False)
    m.same_tables_and_pools()
    vres, kres = m.vc.resident_managers[0], m.kc.resident_managers[0]
    assert [b.block_id for b in vres.get_residency_row("r0")][:2] == [0, 0]
    donor_v, donor_k = vres.get_resident_page("r1", 0), kres.get_resident_page("r1", 0)
    assert donor_v.block_id == donor_k.block_id
    assert vres.adopt_resident_page("r0", 0, donor_v) is kres.adopt_resident_page("r0", 0, donor_k) is True
    assert vres.adopt_resident_page("r0", 0, donor_v) is kres.adopt_resident_page("r0", 0, donor_k) is False
    assert vres.adopt_resident_page("r0", 9, donor_v) is kres.adopt_resident_page("r0", 9, donor_k) is False
    m.same_tables_and_pools()
    assert vres.drop_resident_page("r0", 0).block_id == kres.drop_resident_page("r0", 0).block_id
    assert vres.drop_resident_page("r0", 1) is kres.drop_resident_page("r0", 1) is None
    m.same_tables_and_pools()
    assert {p: b.block_id for p, b in kres.residency_changes["r0"].items()} == {0: 0}
    m.vc.commit_computed_blocks("r0", 2)
    m.kc.commit_computed_blocks("r0", 2)
    m.same_tables_and_pools()
    assert m.kc.request_states["r0"].pages_to_adopt == m.vc.request_states["r0"].pages_to_adopt == 2
    # bad input: a block of another pool, the null block, a negative count; nothing changed
    before = dict(kres.residency_changes["r0"])
    host_block = m.kc.host_manager.block_pool.blocks[1]
    with pytest.raises(TypeError):
        kres.adopt_resident_page("r0", 1, host_block)
    with pytest.raises(ValueError):
        kres.adopt_resident_page("r0", 1, m.km.block_pool.null_block)
    with pytest.raises(ValueError):
        m.kc.commit_computed_blocks("r0", -1)
    assert dict(kres.residency_changes["r0"]) == before


def test_host_kv_events_share_the_device_queue_as_vllm_s():
    # a prompt's pages spill and publish on the host pool (BlockStored, medium CPU, group 0),
    # a second request reads them back (the hit's BlockStored, host), the host pool evicts
    # one (BlockRemoved, medium CPU): the same events, in the same order, as vLLM's manager
    m = HiSparseManagerLockstep()
    m.setup(num_blocks=32, host_num_blocks=16, max_in_flight_tokens=None, caching=True, events=True)
    m.admit(request="r0", prompt=64, external=0, must_fit=False)
    m.connector_step()
    m.same_tables_and_pools()  # compares the events and drains them
    assert COVERAGE["host events"]
    m.free(request="r0", finished=True)
    m.admit(request="r1", prompt=64, external=0, must_fit=False)
    m.connector_step()
    v, k = m.vm.take_events(), m.km.take_events()
    assert v == k
    host = [b.block_id for b in m.km.get_blocks("r1").blocks[0] if not b.is_null][:1]
    for c in (m.vc, m.kc):
        c.host_manager.block_pool.evict_blocks(set(host))
    v, k = m.vm.take_events(), m.km.take_events()
    assert v == k and [(e.medium, e.group_idx) for e in k if type(e).__name__ == "BlockRemoved"] != []
