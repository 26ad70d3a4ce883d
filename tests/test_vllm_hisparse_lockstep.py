"""kvblock's HiSparse residency (the Rust core's ``hisparse::residency``, through the
``_core.HiSparseResidency`` harness over two kvblock pools) against vLLM's own
``HiSparseCoordinator``, in lockstep.

vLLM's side is its stock ``KVCacheManager`` built with a HiSparse configuration in the layout
of vLLM's own HiSparse tests (source group on the host pool, indexer, resident, hot with two
blocks per request, block size 16), and ``get_hisparse_coordinator``. A hypothesis state machine
gives requests host and resident pages (and hot regions when vLLM's hot manager asks for
them) by calling each side's pools the same way, then drives both coordinators: scheduled
steps (``advance_scheduled``), ``update_residency``, offload commands, worker reports
(``update_spills`` with partial and repeated counts), host imports (recorded, then finished
or failed: the last page restored), row mirrors and the all-resident check, device-pool pressure from other
allocations (which reuses released pages: the reuse watchers), residency updates and frees
in vLLM's manager order. After every step: the same transfers, pending spills, request states,
residency rows, hot requirements, free queues and ref counts of both pools, and the same
``has_pending_work`` / ``has_pending_reclamation``.

With prefix caching on, requests (vLLM ``Request`` objects with one prompt, hashed by vLLM's
own hasher) also publish their host blocks (``publish_when_ready``: as spills complete, and a
finished request's detached blocks after its last spill), and later requests hit that host
prefix (``commit_computed_blocks``): their pages come back device-resident from the recorded
copies. Then host block hashes and ``copies`` are compared too; where two requests of one
prompt publish in one ``update_spills``, vLLM's winner in ``copies`` follows a set's string-hash
order (PYTHONHASHSEED), so kvblock's (completion order) is checked to be one vLLM could pick and
vLLM's is aligned to it.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from conftest import require_module

require_module("vllm")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from kvblock import _core  # noqa: E402
from kvblock.vllm.block_pool import BlockPool  # noqa: E402
from kvblock.vllm.originals import original  # noqa: E402
from kvblock.vllm.releases import current  # noqa: E402

hisparse = pytest.importorskip("vllm.v1.hisparse.coordinator")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_manager as _vkm  # noqa: E402
from vllm.v1.core import kv_cache_utils as _vku  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
)

KVCacheManager = original(_vkm, "KVCacheManager")
get_request_block_hasher = original(_vku, "get_request_block_hasher")
init_none_hash = original(_vku, "init_none_hash")
PROMPT = list(range(6 * 16))
EXAMPLES = int(os.environ.get("KVBLOCK_LOCKSTEP_EXAMPLES", "120"))
BS = 16
HOST, RESIDENT, HOT = 0, 2, 3
REQUESTS = ["r0", "r1", "r2"]
#: What the run reached (checked by ``test_hisparse_lockstep_covers_the_transitions``).
COVERAGE: Counter[str] = Counter()


def _config(num_blocks: int, host_num_blocks: int) -> KVCacheConfig:
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


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


class HiSparseLockstep(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(12, 40),
        host_num_blocks=st.integers(6, 24),
        max_model_len=st.sampled_from([64, 128]),
        max_in_flight_tokens=st.sampled_from([None, 32, 48]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, host_num_blocks: int, max_model_len: int, max_in_flight_tokens, caching=False) -> None:
        init_none_hash(sha256)
        self.caching = caching
        self.hasher = get_request_block_hasher(BS, sha256)
        self.requests: dict[str, Request] = {}
        self.vm = KVCacheManager(
            _config(num_blocks, host_num_blocks),
            max_model_len=max_model_len,
            scheduler_block_size=BS,
            hash_block_size=BS,
            max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=caching,
        )
        self.vc = hisparse.get_hisparse_coordinator(self.vm)
        self.vres = self.vc.resident_managers[0]
        self.vhot = self.vc.hot_managers[0]
        self.vhost = self.vc.host_manager
        self.vdev_pool = self.vres.block_pool
        self.vhost_pool = self.vhost.block_pool
        self.dev = BlockPool(num_blocks, caching, BS)
        self.host = BlockPool(host_num_blocks, caching, BS)
        self.kv = _core.HiSparseResidency(
            HOST,
            BS,
            [RESIDENT],
            [self.vres.max_admission_blocks_per_request],
            [(HOT, 2)],
            num_blocks,
            max_model_len,
            self.vc.num_reprefillable_tokens,
            self.dev,
            self.host,
        )
        self.live: set[str] = set()
        self.importing: set[str] = set()
        self.sent: list[int] = []
        self.outsiders: list[tuple[list, list]] = []

    # -- tables, grown on both sides by the same pool calls ------------------------------------

    def _grow(self, group: int, request: str, n: int) -> bool:
        on_host = group == HOST
        vpool, kpool = (self.vhost_pool, self.host) if on_host else (self.vdev_pool, self.dev)
        if n > vpool.get_num_free_blocks():
            return False
        vblocks = vpool.get_new_blocks(n)
        kblocks = kpool.get_new_blocks(n)
        assert _ids(vblocks) == _ids(kblocks)
        vmgr = self.vm.coordinator.single_type_managers[group]
        vmgr.req_to_blocks[request].extend(vblocks)
        self.kv.set_table(group, request, _ids(vmgr.req_to_blocks[request]))
        return True

    @rule(request=st.sampled_from(REQUESTS), pages=st.integers(1, 5))
    def admit(self, request: str, pages: int) -> None:
        if request in self.live:
            return
        if pages > self.vhost_pool.get_num_free_blocks() or pages > self.vdev_pool.get_num_free_blocks():
            return
        assert self._grow(HOST, request, pages) and self._grow(RESIDENT, request, pages)
        self._new_request(request)

    def _new_request(self, request: str) -> None:
        sp = SamplingParams(max_tokens=8)
        self.requests[request] = Request(request, list(PROMPT), sp, None, block_hasher=self.hasher)
        self.kv.set_hashes(request, [bytes(h) for h in self.requests[request].block_hashes])
        self.live.add(request)

    @rule(request=st.sampled_from(REQUESTS), pages=st.integers(1, 4), short=st.integers(0, BS - 1))
    def host_import(self, request: str, pages: int, short: int) -> None:
        # an external load fills host pages; the resident group keeps only the last page
        # writable (vLLM's allocate_external_computed_blocks), the others read from the host
        if request in self.live or pages > self.vhost_pool.get_num_free_blocks() or not self.vdev_pool.get_num_free_blocks():
            return
        assert self._grow(HOST, request, pages)
        self.vres.req_to_blocks[request].extend([self.vdev_pool.null_block] * (pages - 1))
        self.kv.set_table(RESIDENT, request, [0] * (pages - 1))
        assert self._grow(RESIDENT, request, 1)
        tokens = pages * BS - short
        if current().hisparse_import_reservations:  # 0.34: the admission gate sized it first
            full = pages + short % 3
            self.vc.size_import(request, full)
            self.kv.size_import(request, full)
        self.vc.record_pending_host_import(request, tokens)
        self.kv.record_pending_host_import(request, tokens)
        self._new_request(request)
        self.importing.add(request)

    @precondition(lambda self: current().hisparse_import_reservations and self.importing & self.live)
    @rule(data=st.data())
    def import_grows(self, data: st.DataObject) -> None:
        # the import's sequence takes more host pages: its reservation shrinks
        request = data.draw(st.sampled_from(sorted(self.importing & self.live)))
        self._grow(HOST, request, 1)
        held = len(self.vhost.req_to_blocks[request])
        self.vc.update_import_reservation(request, held)
        self.kv.update_import_reservation(request, held)
        COVERAGE["reservations"] += bool(self.vc.reserved_import_pages)

    @precondition(lambda self: self.importing & self.live)
    @rule(data=st.data())
    def host_import_done(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.importing & self.live)))
        failed = data.draw(st.booleans())
        self.vc.finish_host_import(request, failed=failed)
        self.kv.finish_host_import(request, failed)
        self.importing.discard(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def worker_views(self, data: st.DataObject) -> None:
        # the rows to mirror into the host cache and the all-resident check of a scheduled batch
        batch = []
        for request in data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=2, unique=True)):
            pages = len(self.vres.req_to_blocks.get(request, ()))
            computed = data.draw(st.integers(0, pages * BS))
            batch.append((request, computed, data.draw(st.integers(0, 2 * BS))))
        theirs = self.vc.build_row_mirrors(batch)
        assert self.kv.build_row_mirrors(batch) == [
            (list(m.source_starts), m.destination_start, m.num_rows) for m in theirs
        ]
        assert self.kv.all_context_pages_resident(batch) == self.vc.all_context_pages_resident(batch)
        COVERAGE["mirrors"] += bool(theirs)

    @precondition(lambda self: self.caching and self.live)
    @rule(data=st.data())
    def publish_when_ready(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        pages = min(len(self.vhost.req_to_blocks.get(request, ())), len(PROMPT) // BS)
        tokens = max(0, pages * BS - data.draw(st.integers(0, BS)))
        self.vc.publish_when_ready(self.requests[request], tokens, None, replay_boundaries=())
        self.kv.publish_when_ready(request, tokens)

    @precondition(lambda self: self.caching and self.live)
    @rule(data=st.data())
    def host_prefix_hit(self, data: st.DataObject) -> None:
        # a new request whose prompt's first pages are cached host blocks of a live one
        free = [r for r in REQUESTS if r not in self.live]
        if not free:
            return
        source = data.draw(st.sampled_from(sorted(self.live)))
        hashed = 0
        for b in self.vhost.req_to_blocks.get(source, ()):
            if b.block_hash is None:
                break
            hashed += 1
        if hashed == 0:
            return
        self._hit(source, free[0], data.draw(st.integers(1, hashed)))

    def _hit(self, source: str, request: str, k: int) -> None:
        vblocks = list(self.vhost.req_to_blocks[source][:k])
        self.vhost_pool.touch(vblocks)
        self.host.touch([self.host.blocks[b.block_id] for b in vblocks])
        self.vhost.req_to_blocks[request].extend(vblocks)
        self.vhost.num_cached_block[request] = k  # hit blocks are cached already (vLLM's admission)
        self.vres.req_to_blocks[request].extend([self.vdev_pool.null_block] * k)
        self.kv.set_table(HOST, request, _ids(vblocks))
        self.kv.set_table(RESIDENT, request, [0] * k)
        self._new_request(request)
        self.vc.commit_computed_blocks(request, k)
        self.kv.commit_computed_blocks(request, k)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow_one_page(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        if self.vhost_pool.get_num_free_blocks() and self.vdev_pool.get_num_free_blocks():
            assert self._grow(HOST, request, 1) and self._grow(RESIDENT, request, 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def allocate_hot_region(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        if request not in self.vhot.hot_required:
            return
        missing = 2 - len(self.vhot.req_to_blocks.get(request, ()))
        if missing > 0:
            self._grow(HOT, request, missing)

    # -- the coordinator's calls ---------------------------------------------------------------

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def advance_scheduled(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        pages = len(self.vres.req_to_blocks.get(request, ()))
        tokens = max(0, pages * BS - data.draw(st.integers(0, BS)))
        self.vc.advance_scheduled([(request, tokens)])
        self.kv.advance_scheduled([(request, tokens)])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def update_residency(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        self.vc.update_residency(request)
        self.kv.update_residency(request)

    @rule()
    def offload_command(self) -> None:
        theirs = self.vc.build_offload_command().page_transfers
        ours = self.kv.take_offload_command()
        if current().hisparse_after_forward:
            assert ours == [
                (t.transfer_id, t.host_block_id, list(t.resident_block_ids), t.after_forward, t.restore) for t in theirs
            ]
        else:  # 0.34's transfers have no after_forward
            assert [o[:3] + o[4:] for o in ours] == [
                (t.transfer_id, t.host_block_id, list(t.resident_block_ids), t.restore) for t in theirs
            ]
        self.sent.extend(t.transfer_id for t in theirs)

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def worker_reports(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.sent), max_size=4, unique=True))
        enqueued = {i: data.draw(st.integers(1, 2)) for i in ids if data.draw(st.booleans())}
        completed = {i: 1 for i in ids if data.draw(st.booleans())}
        self._update_spills(enqueued, completed)

    @precondition(lambda self: self.sent)
    @rule()
    def every_worker_done(self) -> None:
        # every transfer sent so far enqueued and completed by the one worker
        counts = {i: 1 for i in self.sent}
        self._update_spills(counts, counts)
        self.sent = []

    def _update_spills(self, enqueued: dict[int, int], completed: dict[int, int]) -> None:
        # vLLM publishes the requests whose spills complete in one call in the order of a
        # set of request ids (`_complete_host_writes`' completed_request_ids): string-hash
        # order, so with two requests of one prompt, which one's GPU copies `copies` keeps
        # depends on PYTHONHASHSEED. kvblock publishes them in completion order. Where the
        # two differ, kvblock's choice must be one vLLM could make (the resident page of
        # another request that completed in this call, at a host page with that hash);
        # vLLM's copies are then set to it so the runs stay in lockstep.
        candidates = {p.page[0] for p in self.vc.pending_spills.values()}
        self.vc.update_spills(enqueued, completed)
        self.kv.update_spills(sorted(enqueued.items()), sorted(completed.items()))
        ours = dict(self.kv.copies())
        theirs = {bytes(k): k for k in self.vc.copies}
        assert sorted(ours) == sorted(theirs)
        for key, blocks in ours.items():
            if blocks == _ids(self.vc.copies[theirs[key]]):
                continue
            assert len(candidates) >= 2, (key, blocks)
            chosen = [
                (r, i)
                for r in candidates
                for i, hb in enumerate(self.vhost.req_to_blocks.get(r, ()))
                if hb.block_hash is not None
                and bytes(hb.block_hash) == key
                and [b.block_id for b in (self.vres.get_resident_page(r, i),) if b is not None] == blocks
            ]
            assert chosen, (key, blocks)
            r, i = chosen[0]
            self.vc._drop_copy(theirs[key])
            self.vc.copies[theirs[key]] = (self.vres.get_resident_page(r, i),)
            self.vc._copy_by_block[blocks[0]] = theirs[key]

    @rule(n=st.integers(1, 6), all_free=st.booleans())
    def other_allocations(self, n: int, all_free: bool) -> None:
        # other requests take device blocks: released pages at the queue's tail get reused
        if all_free:
            n = self.vdev_pool.get_num_free_blocks()
        if n == 0 or n > self.vdev_pool.get_num_free_blocks():
            return
        theirs = self.vdev_pool.get_new_blocks(n)
        ours = self.dev.get_new_blocks(n)
        assert _ids(ours) == _ids(theirs)
        self.outsiders.append((ours, theirs))

    @precondition(lambda self: self.outsiders)
    @rule()
    def other_frees(self) -> None:
        ours, theirs = self.outsiders.pop(0)
        self.vdev_pool.free_blocks(reversed(theirs))
        self.dev.free_blocks(list(reversed(ours)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self._free(data.draw(st.sampled_from(sorted(self.live))), data.draw(st.booleans()))

    def _free(self, request: str, finished: bool = False) -> None:
        host, hot = self._table(HOST, request), self._table(HOT, request)
        if finished:  # finished, not preempted: spills still running publish the prefix later
            self.requests[request].status = RequestStatus.FINISHED_STOPPED
        # vLLM's KVCacheManager.free: each group's manager in group order
        for mgr in self.vm.coordinator.single_type_managers:
            mgr.free(request)
        self.kv.free(request, finished)
        self.host.free_blocks([self.host.blocks[b] for b in reversed(host)])
        row = [b for b in self.kv.get_residency_row(0, request, 0) if b != 0]
        self.dev.free_blocks([self.dev.blocks[b] for b in reversed(row)])
        self.dev.free_blocks([self.dev.blocks[b] for b in reversed(hot)])
        for g in (HOST, RESIDENT, HOT):
            self.kv.set_table(g, request, None)
        self.kv.forget(request)
        self.live.discard(request)
        self.importing.discard(request)

    def _table(self, group: int, request: str) -> list[int]:
        return self._kv_tables.get((group, request), [])

    @rule()
    def residency_updates(self) -> None:
        requests = sorted(self.live)
        theirs = self.vc.take_residency_updates(requests)
        ours = self.kv.take_residency_updates(requests)
        assert ours == [(r, u.pages, [list(g) for g in u.block_ids]) for r, u in theirs.items()]

    # -- the comparison ------------------------------------------------------------------------

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "kv"):
            return
        # the reuse watchers fired by the last pool calls are applied on the next Rust call
        assert self.kv.has_pending_reclamation() == self.vc.has_pending_reclamation()
        assert self.kv.has_pending_work() == self.vc.has_pending_work()
        for vpool, kpool in ((self.vdev_pool, self.dev), (self.vhost_pool, self.host)):
            assert _ids(kpool.free_block_queue.get_all_free_blocks()) == _ids(vpool.free_block_queue.get_all_free_blocks())
            assert [b.ref_cnt for b in kpool.blocks][1:] == [b.ref_cnt for b in vpool.blocks][1:]
        assert self.kv.pending_spills() == [
            (
                p.transfer_id,
                p.page[0],
                p.page[1],
                p.host_block.block_id,
                _ids(p.resident_blocks),
                p.restore,
                p.expected_worker_completions,
                p.worker_completions,
                p.enqueue_applied,
            )
            for p in self.vc.pending_spills.values()
        ]
        theirs = {
            r: {
                "valid_pages": sorted(s.valid_pages),
                "ready_prefix_pages": s.ready_prefix_pages,
                "pending_pages": sorted(s.pending_pages.items()),
                "copies_recorded_blocks": s.copies_recorded_blocks,
                "pinned_clean": sorted(s.pinned_clean),
                "unpinned_pages": sorted(s.unpinned_pages),
                "pages_to_adopt": s.pages_to_adopt,
                "synced_pages": s.synced_pages,
                "stale_pages": sorted(s.stale_pages),
                "publication": None
                if s.publication is None
                else (s.publication.num_computed_tokens, s.publication.num_pages),
            }
            for r, s in self.vc.request_states.items()
        }
        assert self.kv.request_states() == theirs
        for state in theirs.values():
            for field in ("valid_pages", "pinned_clean", "unpinned_pages", "stale_pages", "pending_pages"):
                COVERAGE[field] += bool(state[field])
        COVERAGE["hot_required"] += bool(self.vhot.hot_required)
        COVERAGE["restore"] += any(p.restore for p in self.vc.pending_spills.values())
        COVERAGE["lost"] += any(0 in self.vres.req_to_blocks.get(r, ()) or 0 in _ids(self.vres.get_residency_row(r)) for r in self.vc.request_states)
        assert self.kv.hot_required(0) == sorted(self.vhot.hot_required)
        if current().hisparse_import_reservations:
            assert self.kv.reserved_import_pages() == self.vc.reserved_import_pages
        assert self.kv.copies() == sorted((bytes(k), _ids(v)) for k, v in self.vc.copies.items())
        hashes = [None if b.block_hash is None else bytes(b.block_hash) for b in self.vhost_pool.blocks]
        assert [None if b.block_hash is None else bytes(b.block_hash) for b in self.host.blocks] == hashes
        COVERAGE["copies"] += bool(self.vc.copies)
        COVERAGE["adopted"] += any(
            t.is_null and not x.is_null
            for r in self.vc.request_states
            for t, x in zip(self.vres.req_to_blocks.get(r, ()), self.vres.get_residency_row(r))
        )
        COVERAGE["detached"] += any(p.request_state.publication is not None and p.page[0] not in self.vc.request_states for p in self.vc.pending_spills.values())
        for request in REQUESTS:
            assert self.kv.get_residency_row(0, request, 0) == _ids(self.vres.get_residency_row(request))

    @property
    def _kv_tables(self) -> dict[tuple[int, str], list[int]]:
        # the harness's tables are vLLM's own (set after every growth): read them from vLLM
        out = {}
        for g in (HOST, RESIDENT, HOT):
            for r, blocks in self.vm.coordinator.single_type_managers[g].req_to_blocks.items():
                out[(g, r)] = _ids(blocks)
        return out


HiSparseLockstep.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_hisparse_lockstep = HiSparseLockstep.TestCase


def test_hisparse_lockstep_release_and_loss() -> None:
    """A directed run through the path random steps rarely reach: pages spilled and clean, the
    pool runs low so a hot region is asked for, clean pages released once it is allocated, the
    worker synced, then other allocations reuse the released blocks: the pages are lost and
    sent again as stale; finally the request is freed. Both sides compared after each step."""
    m = HiSparseLockstep()
    m.setup(num_blocks=32, host_num_blocks=16, max_model_len=128, max_in_flight_tokens=None)
    m.admit("r0", 5)
    m.admit("r1", 2)
    m.same_state()
    for r, n in (("r0", 80), ("r1", 32)):
        m.vc.advance_scheduled([(r, n)])
        m.kv.advance_scheduled([(r, n)])
    m.offload_command()
    m.every_worker_done()
    m.same_state()
    m.other_allocations(23, False)  # 2 free blocks left: under the watermark (3)
    for r in ("r0", "r1"):
        m.vc.update_residency(r)
        m.kv.update_residency(r)
    m.same_state()
    assert sorted(m.vhot.hot_required) == ["r0", "r1"]
    m.other_frees()
    m._grow(HOT, "r0", 2)
    m.vc.update_residency("r0")
    m.kv.update_residency("r0")
    m.same_state()
    assert sorted(m.vc.request_states["r0"].unpinned_pages) == [0, 1, 2]
    m.residency_updates()
    m.other_allocations(0, True)
    m.same_state()
    assert m.vc.request_states["r0"].stale_pages
    m.residency_updates()
    m.same_state()
    m._free("r0")
    m.same_state()
    m._free("r1")
    m.same_state()


def _step(m: HiSparseLockstep, request: str, tokens: int, publish: bool = False) -> None:
    m.vc.advance_scheduled([(request, tokens)])
    m.kv.advance_scheduled([(request, tokens)])
    if publish:
        m.vc.publish_when_ready(m.requests[request], tokens, None, replay_boundaries=())
        m.kv.publish_when_ready(request, tokens)
    m.same_state()


def test_hisparse_lockstep_publication_hit_and_detached() -> None:
    """Directed, with prefix caching: a request's host blocks publish as its spills complete
    (with device copies recorded), a second request hits that host prefix and adopts the
    copies, and a finished request whose spills still run publishes its detached blocks
    once they complete. Both sides compared after each step."""
    m = HiSparseLockstep()
    m.setup(num_blocks=32, host_num_blocks=16, max_model_len=128, max_in_flight_tokens=None, caching=True)
    m.admit("r0", 4)
    _step(m, "r0", 64, publish=True)
    m.offload_command()
    m.every_worker_done()
    m.same_state()
    assert len(m.vc.copies) == 4
    m._hit("r0", "r1", 3)
    m.same_state()
    m.vc.update_residency("r1")
    m.kv.update_residency("r1")
    m.same_state()
    assert _ids(m.vres.get_residency_row("r1")) == _ids(m.vres.get_residency_row("r0"))[:3]
    m.admit("r2", 2)
    _step(m, "r2", 32, publish=True)
    m.offload_command()
    m._free("r2", True)
    m.same_state()
    assert m.vc.pending_spills and "r2" not in m.vc.request_states
    m.every_worker_done()
    m.same_state()
    for r in ("r0", "r1"):
        m._free(r, True)
        m.same_state()


def test_residency_refuses_vllms_bad_layouts() -> None:
    """vLLM's coordinator refuses a host group after a resident group; so does kvblock's,
    with vLLM's message, before anything is built."""
    dev, host = BlockPool(8, False, BS), BlockPool(8, False, BS)
    with pytest.raises(ValueError, match="HiSparse host group must precede resident groups."):
        _core.HiSparseResidency(3, BS, [2], [4], [(1, 2)], 8, 64, 0, dev, host)
    with pytest.raises(ValueError, match="host pool must not be the device pool"):
        _core.HiSparseResidency(0, BS, [2], [4], [(3, 2)], 8, 64, 0, dev, dev)


def test_residency_refuses_block_ids_outside_their_pool() -> None:
    """A table naming a block its group's pool does not have is refused (ValueError) and
    nothing is set: the residency never reaches a pool with a bad id."""
    dev, host = BlockPool(8, False, BS), BlockPool(4, False, BS)
    kv = _core.HiSparseResidency(0, BS, [2], [4], [(3, 2)], 8, 64, 0, dev, host)
    kv.set_table(HOST, "r", [1, 2])
    with pytest.raises(ValueError):
        kv.set_table(HOST, "r", [1, 5])  # the host pool has 4 blocks
    with pytest.raises(ValueError):
        kv.set_table(RESIDENT, "r", [8])
    kv.set_table(RESIDENT, "r", [5, 6])  # fine on the device pool
    assert kv.get_residency_row(0, "r", 0) == [5, 6]
    kv.advance_scheduled([("r", 32)])  # the host table is still [1, 2]
    assert [t[1] for t in kv.take_offload_command()] == [1, 2]


def test_hisparse_lockstep_import_reservation() -> None:
    """Directed, vLLM 0.34's import reservations: an external load sized at four host pages
    holds two, then takes a third and reserves the fourth; both sides keep the same reserved
    pages (the random runs reach this only sometimes), then the import finishes and the
    request is freed."""
    if not current().hisparse_import_reservations:
        pytest.skip("this vLLM has no HiSparse import reservations")
    m = HiSparseLockstep()
    m.setup(num_blocks=32, host_num_blocks=16, max_model_len=128, max_in_flight_tokens=None)
    m.host_import("r0", 2, 2)  # sized at 2 + 2 % 3 = 4 pages, holding 2
    m.same_state()
    assert m.vc.reserved_import_pages == 0  # reserved at the first update (vLLM's order)
    assert m._grow(HOST, "r0", 1)
    held = len(m.vhost.req_to_blocks["r0"])
    m.vc.update_import_reservation("r0", held)
    m.kv.update_import_reservation("r0", held)
    COVERAGE["reservations"] += bool(m.vc.reserved_import_pages)
    m.same_state()
    assert m.vc.reserved_import_pages == 1  # 4 pages sized, 3 held
    m.vc.finish_host_import("r0", failed=False)
    m.kv.finish_host_import("r0", False)
    m.importing.discard("r0")
    m.same_state()
    m._free("r0")
    m.same_state()


def test_hisparse_lockstep_covers_the_transitions() -> None:
    """The runs above (random and directed) reached every residency state: clean, pinned,
    released (unpinned), lost (stale for the worker), spills running, hot regions asked."""
    if not COVERAGE:
        pytest.skip("runs after the lockstep tests of this file")
    wanted = ["reservations"] if current().hisparse_import_reservations else []
    missing = [k for k in wanted + ["valid_pages", "pinned_clean", "unpinned_pages", "stale_pages", "pending_pages",
                           "hot_required", "lost", "copies", "adopted", "detached",
                           "restore", "mirrors"] if not COVERAGE[k]]
    assert not missing, (missing, COVERAGE)
