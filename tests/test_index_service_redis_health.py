"""``kvblock index serve --redis``: /health says whether Redis answers at every moment, not
only after a /score reached it, and an unreachable Redis at start is one warning line
(issue 34, a fresh user's find: a readiness probe passed a service that could not work).
A real ``redis-server`` on loopback, stopped and restarted, and a closed port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cluster_helpers import free_port
from conftest import require_module
from redis_fixtures import redis_node  # noqa: F401  (the fixture)

for _m in ("aiohttp", "prometheus_client", "zmq", "redis"):
    require_module(_m)

from kvblock.cluster.service import IndexService, ServiceConfig, ServiceThread  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_is_503_from_the_start_when_redis_is_a_closed_port():
    svc = IndexService(ServiceConfig(redis=f"redis://127.0.0.1:{free_port()}"))
    with ServiceThread(svc) as st:
        status, body = health(st.url)  # no /score before it
        assert (status, body["status"], body["index"]) == (503, "unavailable", "redis")


def test_health_follows_a_real_redis_down_and_up(redis_node):  # noqa: F811
    svc = IndexService(ServiceConfig(redis=redis_node.url))
    with ServiceThread(svc) as st:
        assert health(st.url)[0] == 200
        redis_node.stop()
        status, body = health(st.url)  # no /score in between
        assert (status, body["status"]) == (503, "unavailable")
        redis_node.start()
        assert health(st.url) == (200, {**body, "status": "ok"})


def test_serve_warns_once_at_start_when_redis_does_not_answer():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    redis_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvblock", "index", "serve", "--port", "0", "--redis",
                             f"redis://127.0.0.1:{redis_port}", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the serving line: printed once bound
        assert line.startswith("kvblock index serve: serving on http://127.0.0.1:"), line
        assert f"redis redis://127.0.0.1:{redis_port} (not answering: /health 503 until it does)" in line
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    warnings = [ln for ln in err.splitlines() if "WARNING" in ln]
    assert len(warnings) == 1 and "Redis is unavailable" in warnings[0], err
    assert proc.returncode == 130, err
