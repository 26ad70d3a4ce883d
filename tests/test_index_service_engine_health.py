"""An engine ``kvblock index serve`` cannot reach is named, with the cause, in a warning that
backs off (1st, 2nd, 4th, 8th ... failure in a row), counted in /metrics, and reported by
/health as ``degraded`` with the engine's state (issue 34, a fresh user's find: the README's
example host logged the same causeless warning every second and /health stayed "ok").
Real ZMQ sockets; an unresolvable host name and a closed loopback port."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request

from cluster_helpers import free_port
from conftest import require_module

for _m in ("aiohttp", "prometheus_client", "zmq"):
    require_module(_m)

from kvblock.cluster import KVEventSubscriber, PrefixIndex  # noqa: E402
from kvblock.cluster.service import IndexService, ServiceConfig, ServiceThread, parse_engine  # noqa: E402

NOWHERE = "kvblock-no-such-host.invalid"  # RFC 2606: never resolves


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_an_unresolvable_engine_is_named_counted_and_degrades_health(caplog):
    caplog.set_level(logging.WARNING, logger="kvblock.cluster")
    engines = parse_engine(f"a=tcp://{NOWHERE}:5557,replay=tcp://{NOWHERE}:5558")
    svc = IndexService(ServiceConfig(idle_sync_s=0.05), engines)
    svc.subscriber.replay_timeout_s = 0.05
    with ServiceThread(svc) as st:
        status, body = get(st.url + "/health")
        health = json.loads(body)
        assert status == 200 and health["status"] == "degraded"
        assert health["engines_down"] == {"a": "never_connected"}
        deadline = time.monotonic() + 60  # a wait for the subscriber thread, not a timing check
        while 'kvblock_index_replay_failures_total{engine="a"} 0.0' in get(st.url + "/metrics")[1]:
            assert time.monotonic() < deadline, "no replay was tried"
            time.sleep(0.05)
        assert 'kvblock_index_engine_up{engine="a"} 0.0' in get(st.url + "/metrics")[1]
        view = json.loads(get(st.url + "/engines")[1])["engines"][0]
        assert view["state"] == "never_connected" and view["replay_failures"] >= 1
    warnings = [r.getMessage() for r in caplog.records if "replay from" in r.getMessage()]
    assert warnings and f"host {NOWHERE!r} does not resolve" in warnings[0], warnings


def test_the_warning_backs_off_and_names_a_closed_port(caplog):
    caplog.set_level(logging.WARNING, logger="kvblock.cluster")
    port = free_port()
    sub = KVEventSubscriber(PrefixIndex(16), replay_timeout_s=0.05, idle_sync_s=None)
    try:
        stream = sub.add_engine("b", f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{port}")
        for _ in range(9):
            assert stream.catch_up() == 0
        eng = sub.engines["b"]
        assert (eng.replay_failures, eng.replay_streak, eng.state()) == (9, 9, "never_connected")
    finally:
        sub.close()
    warnings = [r.getMessage() for r in caplog.records if "replay from" in r.getMessage()]
    assert [w.split("; ")[1].split(" ")[0] for w in warnings] == ["1", "2", "4", "8"], warnings
    assert all(f"nothing answered at tcp://127.0.0.1:{port} within 0.05 s" in w for w in warnings), warnings


def wait_state(url: str, want: dict[str, str]) -> None:
    """Until /health's engines_down is ``want`` (the subscriber thread sees sockets change)."""
    deadline = time.monotonic() + 60
    while json.loads(get(url + "/health")[1])["engines_down"] != want:
        assert time.monotonic() < deadline, get(url + "/health")
        time.sleep(0.05)


def test_an_engine_that_stops_is_reported_and_its_return_clears_it():
    """A real publisher: ok while it runs, ``disconnected`` once it is gone, ok again when an
    engine publishes on the same addresses."""
    from kvblock.cluster import KVEventPublisher

    port, rport = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
    svc = IndexService(ServiceConfig(idle_sync_s=0.05),
                       parse_engine(f"a=tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{rport}"))
    try:
        with ServiceThread(svc) as st:
            wait_state(st.url, {})
            assert json.loads(get(st.url + "/health")[1])["status"] == "ok"
            pub.close()
            wait_state(st.url, {"a": "disconnected"})
            assert json.loads(get(st.url + "/health")[1])["status"] == "degraded"
            pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
            wait_state(st.url, {})
    finally:
        pub.close()


def _score(url: str, hashes: list[int]) -> dict:
    req = urllib.request.Request(url + "/score", data=json.dumps({"block_hashes": hashes}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read().decode())


def test_a_disconnected_engines_claims_are_withheld_until_it_resyncs():
    """An engine whose stream disconnected is answered 0 and named in ``withheld`` (its
    removals cannot reach the service: claiming its blocks could over-report); its entries
    come back when it reconnects and the stream resynchronises (issue 34, a fresh user's
    find: a killed engine kept its whole credit). Real publishers, real sockets."""
    from kvblock.cluster import KVEventPublisher
    from kvblock.events import BlockStored, encode_batch

    port, rport, port_b = free_port(), free_port(), free_port()
    stored = BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=list(range(48)),
                         block_size=16, lora_id=None, medium="GPU", lora_name=None)
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
    pub_b = KVEventPublisher(f"tcp://127.0.0.1:{port_b}", None)
    svc = IndexService(ServiceConfig(idle_sync_s=0.05),
                       parse_engine(f"a=tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{rport}")
                       + parse_engine(f"b=tcp://127.0.0.1:{port_b}"))
    try:
        with ServiceThread(svc) as st:
            wait_state(st.url, {})
            deadline = time.monotonic() + 60  # waits for the subscriber thread, not timing checks
            while _score(st.url, [11, 12, 13])["instances"] != {"a": 48, "b": 48}:
                assert time.monotonic() < deadline
                for p in (pub, pub_b):  # the SUB sockets may join late: publish until seen
                    p.publish_payload(encode_batch([stored], ts=time.time()))
                time.sleep(0.05)
            assert "withheld" not in _score(st.url, [11, 12, 13])
            pub.close()
            wait_state(st.url, {"a": "disconnected"})
            answer = _score(st.url, [11, 12, 13])
            assert answer["instances"] == {"a": 0, "b": 48} and answer["withheld"] == ["a"]
            assert svc.pairs() == 6  # kept, only not claimed
            pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
            wait_state(st.url, {})
            assert "withheld" not in _score(st.url, [11, 12, 13])
            while _score(st.url, [11, 12, 13])["instances"]["a"] != 48:
                assert time.monotonic() < deadline
                pub.publish_payload(encode_batch([stored], ts=time.time()))
                time.sleep(0.05)
    finally:
        pub.close()
        pub_b.close()
