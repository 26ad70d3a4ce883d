"""Real ``redis-server`` processes for the tests: one node, and a three-node Redis Cluster.

The servers run from temporary directories on free loopback ports, without persistence,
and are stopped at the end. Import the fixtures into a test module
(``from redis_fixtures import redis_node, redis_cluster``). Without ``redis-server``
(Debian's ``redis-server`` package) the tests skip, except under ``CI=true`` where they fail:
``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cluster_helpers import free_cluster_port, free_port

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (apt-get install redis-server)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _redis_py() -> None:
    """redis-py: a missing one fails under CI=true and skips elsewhere."""
    if IN_CI:
        import redis  # noqa: F401
    else:
        pytest.importorskip("redis")


class RedisServer:
    """One ``redis-server`` on 127.0.0.1:``port``; :meth:`stop` / :meth:`start` kill and
    restart it on the same port (its data is lost: no persistence)."""

    def __init__(self, workdir: Path, port: int | None = None, cluster: bool = False) -> None:
        self.binary = _binary("redis-server")
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.dir = workdir / f"node-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--protected-mode", "no", "--loglevel", "warning"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}")
            try:
                with redis.Redis(port=self.port, socket_timeout=0.5) as c:
                    if c.ping():
                        return
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self, **kw):
        import redis

        return redis.Redis(port=self.port, **kw)


class RedisCluster:
    """Three ``redis-server --cluster-enabled yes`` masters joined with
    ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, n: int = 3) -> None:
        self.nodes = [RedisServer(workdir, cluster=True) for _ in range(n)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = _binary("redis-cli")
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = []
            for n in self.nodes:
                with n.client(socket_timeout=1) as c:
                    states.append(c.execute_command("CLUSTER", "INFO").decode().split("\r\n")[0])
            if all(s == "cluster_state:ok" for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the Redis Cluster did not become ready: {states}")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def client(self):
        import redis

        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port)


@pytest.fixture
def redis_node(tmp_path_factory):
    """A fresh one-node ``redis-server`` per test (the test may stop and restart it)."""
    _redis_py()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A three-node Redis Cluster for the session (flush it between tests if needed)."""
    _redis_py()
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


__all__ = ["RedisCluster", "RedisServer", "redis_cluster", "redis_node"]
