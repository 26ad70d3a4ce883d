"""KV events on the wire, proven against vLLM 0.33.0 itself on real ZMQ sockets.

* vLLM's own ``ZmqEventPublisher`` (PUB + replay ROUTER) -> kvblock's ``KVEventSubscriber``
  -> ``PrefixIndex``: the index equals the pure-Python reference fed vLLM's structs; a
  late joiner and a subscriber that lost batches (high-water marks of 1) are filled through
  vLLM's replay socket; a restarted vLLM publisher (batch numbers from 0 again) is detected.
* kvblock's ``KVEventPublisher`` (a real ``KVCacheManager``'s ``take_events()``) -> a raw
  ZMQ SUB socket decoded with vLLM's msgspec ``KVEventBatch`` decoder, and vLLM's replay
  protocol against kvblock's ROUTER socket.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

from cluster_helpers import chain, free_port, poll_until, rebind
from conftest import require_module

kv_events = require_module("vllm.distributed.kv_events")

from kvblock import KVCacheManager, Request, SamplingParams, hashing  # noqa: E402
from kvblock.cluster import DictIndex, KVEventPublisher, KVEventSubscriber, PrefixIndex  # noqa: E402


def vllm_stored(hashes, parent=None, medium="GPU"):
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(16 * len(hashes))),
                                 block_size=16, lora_id=None, medium=medium, lora_name=None)


def vllm_removed(hashes, medium="GPU"):
    return kv_events.BlockRemoved(block_hashes=hashes, medium=medium)


def vllm_batch(events):
    return kv_events.KVEventBatch(ts=time.time(), events=events)


def vllm_publisher(port, rport, **kw):
    return kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}", **kw)


def script():
    """A stream of vLLM event batches over four request chains, with evictions and a
    clear: the batches and the reference index state after them."""
    a, b, c = chain(1, 12, shared=4), chain(2, 10, shared=4), chain(3, 6)
    batches = [
        [vllm_stored(a[:4])],
        [vllm_stored(a[4:9], a[3])],
        [vllm_stored(b[4:10], b[3]), vllm_stored(c)],
        [vllm_removed([a[8], a[7]]), vllm_stored(a[9:12], a[8])],
        [vllm_removed(c[3:])],
        [kv_events.AllBlocksCleared(), vllm_stored(a[:6])],
        [vllm_stored(b[4:8], b[3]), vllm_stored(a[6:8], a[5], medium="CPU")],
    ]
    return batches, (a, b, c)


def reference_after(batches):
    ref = DictIndex()
    for evs in batches:
        ref.apply("e0", msgspec.msgpack.encode(vllm_batch(evs)))
    return ref


def same_answers(ix, ref, chains, instance="e0"):
    for ch in chains:
        for medium in (None, "GPU", "CPU"):
            got = ix.match(ch, medium)
            want = ref.match(ch, medium)
            assert got == want, (medium, got, want)


def test_vllm_publisher_to_kvblock_subscriber():
    batches, chains = script()
    port, rport = free_port(), free_port()
    pub = vllm_publisher(port, rport)
    ix = PrefixIndex()
    try:
        with KVEventSubscriber(ix) as sub:
            stream = sub.add_engine("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
            # no wait for the subscription: the first batches are lost to the slow joiner and
            # come back through vLLM's replay socket
            for evs in batches:
                pub.publish(vllm_batch(evs))
            poll_until(sub, lambda: stream.expected == len(batches))
            same_answers(ix, reference_after(batches), chains)
            a = chains[0]
            assert ix.match(a) == {"e0": 8}  # a[:6] GPU + a[6:8] on CPU
            assert ix.match(a, "GPU") == {"e0": 6}
            assert stream.stats.malformed == 0 and stream.stats.lost == 0
    finally:
        pub.shutdown()


def test_lost_batches_are_replayed_from_vllm():
    batches, chains = script()
    port, rport = free_port(), free_port()
    pub = vllm_publisher(port, rport, hwm=1)
    ix = PrefixIndex()
    try:
        with KVEventSubscriber(ix) as sub:
            stream = sub.add_engine("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
            e = sub.engines["e0"].sub
            e.setsockopt(zmq.RCVHWM, 1)
            pub.publish(vllm_batch(batches[0]))
            poll_until(sub, lambda: stream.expected == 1)
            # the subscriber does not read while vLLM publishes: the high-water marks drop batches
            for evs in batches[1:]:
                pub.publish(vllm_batch(evs))
            time.sleep(0.5)
            poll_until(sub, lambda: stream.expected == len(batches))
            same_answers(ix, reference_after(batches), chains)
            assert stream.stats.lost == 0
    finally:
        pub.shutdown()


def test_vllm_publisher_restart_is_detected():
    batches, chains = script()
    port, rport = free_port(), free_port()
    pub = vllm_publisher(port, rport)
    ix = PrefixIndex()
    with KVEventSubscriber(ix) as sub:
        stream = sub.add_engine("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        try:
            for evs in batches[:5]:
                pub.publish(vllm_batch(evs))
            poll_until(sub, lambda: stream.expected == 5)
            assert ix.match(chains[1]) == {"e0": 10}
        finally:
            pub.shutdown()
        # the engine restarts: a new publisher on the same ports numbers from 0 again
        pub2 = rebind(lambda: vllm_publisher(port, rport))
        try:
            d = chain(9, 5)
            pub2.publish(vllm_batch([vllm_stored(d)]))
            poll_until(sub, lambda: ix.match(d) == {"e0": 5})
            # nothing of the old incarnation survives
            for ch in chains:
                assert ix.match(ch) == {}
            assert stream.stats.restarts + stream.stats.resyncs >= 1
        finally:
            pub2.shutdown()


def _manager_events():
    """A real KVCacheManager with events on: two requests sharing a prefix, one freed and
    evicted by a third."""
    mgr = KVCacheManager(12, 4, enable_kv_cache_events=True)
    out = []
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 1000, 16).tolist()
    for i, tail in enumerate([8, 12, 24]):
        toks = shared + rng.integers(0, 1000, tail).tolist() if i < 2 else rng.integers(0, 1000, 40).tolist()
        req = Request(f"r{i}", toks, SamplingParams(max_tokens=1), block_hasher=mgr.request_block_hasher)
        hit, n, _ = mgr.get_computed_blocks(req)
        blocks = mgr.allocate_slots(req, req.num_tokens - n, n, hit)
        if blocks is None:
            continue
        req.num_computed_tokens = req.num_tokens
        out.append(mgr.take_events())
        mgr.free(req)
        out.append(mgr.take_events())
    return [evs for evs in out if evs]


def test_kvblock_publisher_to_vllm_decoder():
    batches = _manager_events()
    assert any(type(e).__name__ == "BlockRemoved" for evs in batches for e in evs), "the script should evict blocks"
    port, rport = free_port(), free_port()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    with KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", topic="kv") as pub:
        # wait until the subscription is through (a probe batch, then start counting)
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            pub.publish([])
            if sub.poll(50):
                got.append(sub.recv_multipart())
        assert got
        first = pub.next_seq
        for evs in batches:
            pub.publish(evs)
        frames = []
        while len(frames) < len(batches):
            assert sub.poll(5000)
            f = sub.recv_multipart()
            if int.from_bytes(f[1], "big") >= first:
                frames.append(f)
        for (topic, seq, payload), evs in zip(frames, batches):
            assert topic == b"kv" and len(seq) == 8
            vb = decoder.decode(payload)  # vLLM's own decoder
            assert vb.data_parallel_rank == 0
            assert [type(e).__name__ for e in vb.events] == [type(e).__name__ for e in evs]
            for ve, ke in zip(vb.events, evs):
                for f in ve.__struct_fields__:
                    want = getattr(ke, f)
                    got_v = getattr(ve, f)
                    if f == "extra_keys" and want is not None:
                        want = [None if k is None else tuple(k) for k in want]
                        got_v = [None if k is None else tuple(k) for k in got_v]
                    assert got_v == want, f
            assert vb.events and all(
                isinstance(h, int) and 0 <= h < 2**64 for e in vb.events for h in getattr(e, "block_hashes", [])
            )
        # vLLM's replay protocol against kvblock's ROUTER: ask from `first`
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rport}")
        dealer.send_multipart((b"", first.to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == kv_events.ZmqEventPublisher.END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert [p for _, p in replayed] == [f[2] for f in frames]
        assert [s for s, _ in replayed] == list(range(first, first + len(batches)))
        dealer.close(0)
    sub.close(0)


def test_kvblock_publisher_to_subscriber_with_faults():
    """kvblock's publisher and subscriber: lost batches replayed, a malformed payload clears
    the instance, events after AllBlocksCleared apply, restart from 0 on new sockets."""
    port, rport = free_port(), free_port()
    a, b = chain(1, 8), chain(2, 8)
    ix = PrefixIndex()
    ref = DictIndex()
    with KVEventSubscriber(ix) as sub:
        stream = sub.add_engine("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", hwm=1)
        sub.engines["e0"].sub.setsockopt(zmq.RCVHWM, 1)
        script = [[vllm_stored(a[:4])], [vllm_stored(a[4:], a[3])], [vllm_removed([a[7]])],
                  [kv_events.AllBlocksCleared()], [vllm_stored(b[:5])], [vllm_removed([b[4]])]]
        for evs in script:
            pub.publish_payload(msgspec.msgpack.encode(vllm_batch(evs)))
            ref.apply("e0", msgspec.msgpack.encode(vllm_batch(evs)))
        time.sleep(0.3)
        poll_until(sub, lambda: stream.expected == len(script))
        assert ix.match(b) == ref.match(b) == {"e0": 4}
        assert ix.match(a) == ref.match(a) == {}
        # a malformed batch: the instance is cleared (never claims what it may not hold)
        pub.publish_payload(b"\x93\xcb not msgpack")
        pub.publish_payload(msgspec.msgpack.encode(vllm_batch([vllm_stored(a[:3])])))
        poll_until(sub, lambda: stream.expected == len(script) + 2)
        assert stream.stats.malformed == 1
        assert ix.match(b) == {} and ix.match(a) == {"e0": 3}
        pub.close()
        pub = rebind(lambda: KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"))
        try:
            pub.publish_payload(msgspec.msgpack.encode(vllm_batch([vllm_stored(b[:2])])))
            poll_until(sub, lambda: ix.match(b) == {"e0": 2})
            assert ix.match(a) == {}  # the old incarnation's blocks are gone
        finally:
            pub.close()


def test_subscriber_thread_feeds_the_index_while_the_router_reads():
    from kvblock.cluster import Router

    port, rport = free_port(), free_port()
    ix = PrefixIndex()
    router = Router(["e0", "e1"], ix, "cache-aware", block_size=16)
    a = chain(4, 6)
    with KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}") as pub, \
            KVEventSubscriber(ix, idle_sync_s=0.2) as sub:
        sub.add_engine("e1", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        sub.start(interval_ms=10)
        pub.publish_payload(msgspec.msgpack.encode(vllm_batch([vllm_stored(a)])))
        deadline = time.monotonic() + 10
        d = router.route(a, 96)
        while d.cached_blocks == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
            d = router.route(a, 96)
        assert d.instance == "e1" and d.cached_blocks == 6
        sub.stop()
