"""``kvblock index serve``'s command line refuses what it cannot serve in one line, before
claiming anything: a port out of range (argparse, exit 2), an address it cannot bind (exit 1,
no "serving" line), a missing ``cluster`` extra package (exit 2, with what to pip-install)
(issue 34, a fresh user's finds)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _serve(args: list[str], blocked: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    block = f"sys.modules[{blocked!r}] = None\n" if blocked else ""
    script = f"import sys\n{block}from kvblock.cli import main\nsys.exit(main(['index', 'serve', *{args!r}]))\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_bad_port_is_refused_by_argparse(port):
    r = _serve(["--port", port])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblock: error: argument --port:"), r.stderr
    assert r.stdout == ""


def test_a_port_in_use_is_one_line_exit_1_and_nothing_claimed():
    pytest.importorskip("aiohttp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _serve(["--port", str(port)])
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvblock: error: cannot listen on 127.0.0.1:{port}"), r.stderr
    assert "serving" not in r.stdout and "starting" not in r.stdout


@pytest.mark.parametrize("module, package", [("aiohttp", "aiohttp"), ("prometheus_client", "prometheus-client"),
                                             ("zmq", "pyzmq")])
def test_a_missing_cluster_package_names_what_to_install(module, package):
    r = _serve(["--port", "0"], blocked=module)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblock: error: "), r.stderr
    assert f"pip install {package} (kvblock's 'cluster' extra)" in lines[0], lines[0]


def test_a_bare_import_of_an_optional_package_gets_the_hint_too():
    """The hint is added where the error is reported, so an import that bypasses
    ``require`` still says what to install."""
    from kvblock._optional import missing_message

    e = ModuleNotFoundError("No module named 'aiohttp'", name="aiohttp")
    assert missing_message(e) == "No module named 'aiohttp': pip install aiohttp (kvblock's 'cluster' extra)"
    inner = ModuleNotFoundError("No module named 'kvblock_nothing'", name="kvblock_nothing")
    assert missing_message(inner) == "No module named 'kvblock_nothing'"


@pytest.mark.parametrize("option,value", [("--redis-ttl-s", "0"), ("--redis-ttl-s", "-5"), ("--redis-ttl-s", "inf"),
                                          ("--max-pairs", "0")])
def test_a_setting_that_would_hold_nothing_is_refused(option, value):
    """A TTL of 0 made every Redis entry expire as it was written and a cap of 0 held nothing,
    while /health said ok: both are refused before anything is served."""
    r = _serve([option, value])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvblock: error: argument {option}:"), r.stderr
    assert r.stdout == ""


def test_the_service_config_refuses_them_too():
    from kvblock.cluster.service import ServiceConfig

    for bad in (0, -1.0, float("inf"), float("nan"), True, "300"):
        with pytest.raises(ValueError, match="redis_ttl_s"):
            ServiceConfig(redis_ttl_s=bad).check()
    with pytest.raises(ValueError, match="max_pairs: must be an int >= 1"):
        ServiceConfig(max_pairs=0).check()
    assert ServiceConfig(redis_ttl_s=0.5, max_pairs=1).check().redis_ttl_s == 0.5


@pytest.mark.parametrize("args,msg", [
    (["--engine", "a=nowhere"], "tcp://"),
    (["--redis", "redis://127.0.0.1:1", "--max-pairs", "10"], "max_pairs"),
    # refused when serving starts (a new user's note: these printed the exception's class)
    (["--engine", "a=tcp://127.0.0.1:1", "--engine", "a=tcp://127.0.0.1:2"], "a name is given twice"),
    (["--redis", "bogus"], "bad Redis URL 'bogus'"),
])
def test_a_bad_setting_is_one_plain_line(args, msg):
    r = _serve(args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblock: error: ") and msg in lines[0], r.stderr
    assert lines[0].endswith(" (see kvblock index serve --help)"), r.stderr
    assert "ValueError" not in r.stderr
