"""Retention beyond LRU in lockstep: kvblock's KVCacheManager (Rust) and the pure-Python
reference, both with priority retention (or plain LRU), pins with a cap and TTLs, one injected
clock, and lookups held back before ``allocate_slots`` so that their hits go stale.

A hypothesis state machine admits requests carrying retention ranges (valid and not), decodes,
frees, moves the clock, pins and unpins prefixes, evicts blocks and probes. After every step:
the same free-queue order (level by level), ref counts, hashes, block generations, tables,
pins and per-block priorities. A call that raises must raise the same kind in both and change
nothing; a stale hit must be refused by both (``StaleHitError``). ``probe`` must change
nothing at all.

Verify on hit is drawn too (full attention only), with the managers' own hasher or a
deliberately colliding one (each block hashed without its parent, or by its position only),
so that hits under forced collisions are compared, and the failure counts with them. With
verify on, every hit block's true prefix (the tokens it was computed from, tracked here)
must be the request's.
"""

from __future__ import annotations

import hashlib
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvblock
import kvblock.hashing as kv_hashing
from kvblock.manager import KVCacheManager
from kvblock.reference import hashing as ref_hashing
from kvblock.reference import retention as ref_retention
from kvblock.reference.manager import KVCacheManager as RefManager
from kvblock.request import Request, RequestStatus

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 50, 60], [7] * 9, [9, 9]]
EXAMPLES = int(os.environ.get("KVBLOCK_LOCKSTEP_EXAMPLES", "60"))

BAD_RANGE = st.tuples(
    st.integers(-1, 20), st.integers(-1, 24), st.integers(-1, 101), st.sampled_from([None, 0.0, 0.7, 3.0, 40.0, -1.0])
)


def _ranges(n):
    """Retention ranges for an ``n``-token prompt: mostly valid, sometimes not."""
    valid = st.integers(0, n - 1).flatmap(
        lambda s: st.tuples(st.just(s), st.integers(s + 1, n), st.integers(0, 100),
                            st.sampled_from([None, 0.0, 0.7, 3.0, 40.0]))
    )
    return st.one_of(st.none(), st.lists(st.one_of(valid, valid, valid, valid, BAD_RANGE), max_size=3))


def _ids(blocks):
    return None if blocks is None else blocks.get_block_ids()[0]


def _weak_hasher(kind, bs):
    """A colliding block hasher: ``unchained`` hashes each block's tokens without its parent,
    ``positional`` hashes only the block's index."""

    def h(req):
        toks = req.all_token_ids
        out = []
        for i in range(len(req.block_hashes), len(toks) // bs):
            what = repr(tuple(toks[i * bs:(i + 1) * bs])) if kind == "unchained" else str(i)
            out.append(hashlib.sha256(what.encode()).digest())
        return out

    h.block_size = bs
    return h


class RetentionLockstep(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 24),
        block_size=st.sampled_from([1, 2, 4]),
        retention=st.sampled_from([True, True, True, False]),
        default=st.sampled_from([35, 35, 0, 100]),
        granularity=st.sampled_from([0.5, 1.0, 2.5]),
        pin_fraction=st.sampled_from([0.0, 0.3, 1.0]),
        window=st.sampled_from([None, None, None, 4]),
        verify=st.booleans(),
        weak=st.sampled_from([None, None, "unchained", "positional"]),
    )
    def setup(self, num_blocks, block_size, retention, default, granularity, pin_fraction, window, verify, weak):
        for mod in (kv_hashing, ref_hashing):
            mod.init_none_hash(mod.get_hash_fn_by_name("sha256"))
        self.t = [100.0]
        kw = dict(
            max_model_len=64, sliding_window=window, priority_retention=retention,
            default_retention_priority=default, decay_granularity_s=granularity,
            max_pinned_fraction=pin_fraction, clock=lambda: self.t[0],
            verify_hits=verify and window is None,
        )
        self.fast = KVCacheManager(num_blocks, block_size, **kw)
        self.ref = RefManager(num_blocks, block_size, **kw)
        self.n = num_blocks
        self.waiting: list[tuple[Request, Request]] = []
        self.running: list[tuple[Request, Request]] = []
        self.looked_up: list[tuple[tuple[Request, Request], tuple]] = []
        self.counter = 0
        self.verify = verify and window is None
        self.hasher = None if weak is None else _weak_hasher(weak, block_size)
        # block id -> (generation, the tokens its KV was computed from)
        self.truth: dict[int, tuple[int, tuple[int, ...]]] = {}

    def _pair(self, prompt, **kw):
        rid = f"r{self.counter}"
        self.counter += 1
        try:
            a = Request(rid, prompt, block_hasher=self.hasher or self.fast.request_block_hasher, **kw)
            b = Request(rid, prompt, block_hasher=self.hasher or self.ref.request_block_hasher, **kw)
        except (ValueError, TypeError):
            # bad retention is refused when the request is built; set afterwards, both
            # managers refuse it at admission, state unchanged
            a = Request(rid, prompt, block_hasher=self.hasher or self.fast.request_block_hasher)
            b = Request(rid, prompt, block_hasher=self.hasher or self.ref.request_block_hasher)
            for r in (a, b):
                for name, value in kw.items():
                    setattr(r, name, value)
        return a, b

    def _learn(self, fa):
        """Record the true prefix of the blocks ``fa`` computed (full blocks it holds that the
        oracle does not know at their current generation)."""
        pool, bs, toks = self.fast.block_pool, self.fast.block_size, list(fa.all_token_ids)
        for j, b in enumerate(self.fast.get_block_ids(fa.request_id)[0]):
            g = pool.block_generation(b)
            if b and (j + 1) * bs <= fa.num_computed_tokens and self.truth.get(b, (None,))[0] != g:
                self.truth[b] = (g, tuple(toks[: (j + 1) * bs]))

    def _check_hits(self, fa, blocks, n):
        """With verify on: every hit block holds KV of exactly the request's prefix."""
        if not (self.verify and n):
            return
        pool, bs, toks = self.fast.block_pool, self.fast.block_size, list(fa.all_token_ids)
        for j, b in enumerate(_ids(blocks)):
            assert self.truth.get(b) == (pool.block_generation(b), tuple(toks[: (j + 1) * bs])), (
                f"verify on: hit block {b} at position {j} holds another prefix's KV"
            )

    def _snapshot(self, mgr):
        pool = mgr.block_pool
        ids = [a.request_id for a, _ in self.waiting + self.running]
        if mgr is self.fast:
            pins = sorted((k, t, list(b), e) for k, t, b, e in mgr.pinned_prefixes)
            gens = [pool.block_generation(i) for i in range(self.n)]
            prios = [None if r is None else r[1] for r in (pool._retention_of(i) for i in range(self.n))]
        else:
            pins = sorted((k, t, [b.block_id for b in bl], e) for k, (bl, t, e) in mgr.pins.items())
            gens = list(pool.generation)
            r = pool.retention
            prios = [None if r is None else r.effective(i) for i in range(self.n)]
        return (
            [mgr.get_block_ids(i) for i in ids],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(pool.blocks[i].ref_cnt, pool.blocks[i].block_hash) for i in range(self.n)],
            gens,
            pins,
            prios,
            mgr.num_pinned_blocks,
            mgr.hit_verification_failures,
        )

    def _same(self, f_fast, f_ref):
        """Both calls, after the clock was read by both (so a call's own reading changes
        nothing); a raising call must raise the same kind and change nothing."""
        self.fast.tick()
        self.ref.tick()
        out = []
        for mgr, f in ((self.fast, f_fast), (self.ref, f_ref)):
            before = self._snapshot(mgr)
            try:
                out.append(f())
            except (ValueError, TypeError, AssertionError) as e:
                assert self._snapshot(mgr) == before, f"{mgr} changed state, then raised {e!r}"
                out.append(e)
        a, b = out
        if isinstance(a, Exception) or isinstance(b, Exception):
            assert type(a).__name__ == type(b).__name__, (a, b)
            if isinstance(a, kvblock.StaleHitError):
                assert isinstance(b, ref_retention.StaleHitError)
            return None, True
        return (a, b), False

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=8), data=st.data(),
          prio=st.sampled_from([None, None, None, 0, 90, 100, 101]))
    def new_request(self, prefix, suffix, data, prio):
        prompt = prefix + suffix
        ranges = data.draw(_ranges(len(prompt)))
        self.waiting.append(self._pair(prompt, retention=ranges, retention_priority=prio))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def look_up(self, data):
        """get_computed_blocks now, allocate_slots later (maybe after other requests evicted
        and reused its hit blocks). probe agrees and changes nothing."""
        pair = data.draw(st.sampled_from(self.waiting))
        fa, ra = pair
        before = (self._snapshot(self.fast), self._snapshot(self.ref))
        assert self.fast.probe(fa) == self.ref.probe(ra)
        assert (self._snapshot(self.fast), self._snapshot(self.ref)) == before
        fb, fn, _ = self.fast.get_computed_blocks(fa)
        rb, rn, _ = self.ref.get_computed_blocks(ra)
        assert (_ids(fb), fn) == (_ids(rb), rn) and fn == self.fast.probe(fa)
        self._check_hits(fa, fb, fn)
        self.looked_up.append((pair, (fb, fn, rb, rn)))

    @precondition(lambda self: self.looked_up)
    @rule(data=st.data())
    def admit(self, data):
        i = data.draw(st.integers(0, len(self.looked_up) - 1))
        pair, (fb, fn, rb, rn) = self.looked_up.pop(i)
        if pair not in self.waiting:
            return
        fa, ra = pair
        res, err = self._same(
            lambda: self.fast.allocate_slots(fa, fa.num_tokens - fn, fn, fb),
            lambda: self.ref.allocate_slots(ra, ra.num_tokens - rn, rn, rb),
        )
        if err:
            return
        a, b = res
        assert _ids(a) == _ids(b)
        if a is None:
            return
        for r in pair:
            r.num_computed_tokens = r.num_tokens
            r.status = RequestStatus.RUNNING
        self._learn(fa)
        self.waiting.remove(pair)
        self.running.append(pair)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def decode(self, data, tok):
        fa, ra = data.draw(st.sampled_from(self.running))
        if fa.num_tokens >= 64:
            return
        for r in (fa, ra):
            r.append_output_token_ids(tok)
        res, err = self._same(lambda: self.fast.allocate_slots(fa, 1), lambda: self.ref.allocate_slots(ra, 1))
        if not err:
            assert _ids(res[0]) == _ids(res[1])
            if res[0] is not None:
                for r in (fa, ra):
                    r.num_computed_tokens = r.num_tokens
                self._learn(fa)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        pair = data.draw(st.sampled_from(self.running))
        self._same(lambda: self.fast.free(pair[0]), lambda: self.ref.free(pair[1]))
        self.running.remove(pair)

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.0, 7.0, 60.0]))
    def advance_clock(self, dt):
        self.t[0] += dt

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), fill=st.integers(0, 3))
    def stale_race(self, data, fill):
        """Look a request up, then admit a fresh request that takes (nearly) every free block,
        then allocate the first with its old hits: a hit block handed out in between must be
        refused by both (StaleHitError), with nothing changed."""
        pair = data.draw(st.sampled_from(self.waiting))
        fa, ra = pair
        fb, fn, _ = self.fast.get_computed_blocks(fa)
        rb, rn, _ = self.ref.get_computed_blocks(ra)
        assert (_ids(fb), fn) == (_ids(rb), rn)
        self._check_hits(fa, fb, fn)
        free = self.fast.block_pool.get_num_free_blocks()
        bs = self.fast.block_size
        tokens = [1000 + self.counter * 64 + i for i in range(max(1, (free - fill) * bs))][:64]
        flood = self._pair(tokens)
        res, err = self._same(
            lambda: self.fast.allocate_slots(flood[0], len(tokens)), lambda: self.ref.allocate_slots(flood[1], len(tokens))
        )
        if not err and res[0] is not None:
            for r in flood:
                r.num_computed_tokens = r.num_tokens
                r.status = RequestStatus.RUNNING
            self._learn(flood[0])
            self.running.append(flood)
        pool = self.fast.block_pool
        moved = [b for b, g in zip(fb.get_block_ids()[0], fb._ids[0].generations or []) if b and pool.block_generation(b) != g] if fn else []
        res, err = self._same(
            lambda: self.fast.allocate_slots(fa, fa.num_tokens - fn, fn, fb),
            lambda: self.ref.allocate_slots(ra, ra.num_tokens - rn, rn, rb),
        )
        if moved:
            assert err, f"stale hit blocks {moved} were accepted"
            return
        if err:
            return
        assert _ids(res[0]) == _ids(res[1])
        if res[0] is not None:
            for r in pair:
                r.num_computed_tokens = r.num_tokens
                r.status = RequestStatus.RUNNING
            self._learn(fa)
            self.waiting.remove(pair)
            self.running.append(pair)

    @rule(prefix=st.sampled_from(PREFIXES), length=st.sampled_from([0, 2, 4, 4, 6, 8, 8]),
          ttl=st.sampled_from([None, None, 0.5, 3.0, 30.0, -2.0]))
    def pin(self, prefix, length, ttl):
        tokens = prefix[:length]
        hashes = Request("p", tokens, block_hasher=self.fast.request_block_hasher).block_hashes
        res, err = self._same(lambda: self.fast.pin_prefix(tokens, ttl), lambda: self.ref.pin_prefix(hashes, ttl))
        if not err:
            assert res[0] == res[1]

    @rule(prefix=st.sampled_from(PREFIXES), length=st.sampled_from([0, 2, 4, 4, 6, 8, 8]))
    def unpin(self, prefix, length):
        tokens = prefix[:length]
        hashes = Request("p", tokens, block_hasher=self.fast.request_block_hasher).block_hashes
        res, err = self._same(lambda: self.fast.unpin_prefix(tokens), lambda: self.ref.unpin_prefix(hashes))
        if not err:
            assert res[0] == res[1]

    @rule(ids=st.lists(st.integers(1, 23), max_size=3))
    def evict(self, ids):
        ids = [i for i in ids if i < self.n]
        self.fast.evict_blocks(set(ids))
        self.ref.evict_blocks(set(ids))

    @invariant()
    def same_state(self):
        if hasattr(self, "fast"):
            assert self._snapshot(self.fast) == self._snapshot(self.ref)
            self.fast.block_pool.check_invariants()


RetentionLockstep.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_retention_lockstep = RetentionLockstep.TestCase
