#!/usr/bin/env bash
# smoke_pythons.sh X.Y ...: for each CPython X.Y found on this machine (other than the one the
# full suite runs on), build kvblock for it and run a smoke subset: the golden vectors, a short
# lockstep of the pool and the manager, vLLM's trace replay, the mixed-prompt vectors and the
# built-in replay from outside the checkout. A missing interpreter is skipped with a message,
# except 3.10 under CI=true (the oldest Python kvblock supports must be tested there).
#
# Each version gets a venv .venv-smoke/X.Y (maturin and the runtime and test dependencies;
# no torch) and a cargo target dir target/smoke-X.Y, kept between runs.
set -uo pipefail
cd "$(dirname "$0")/.."
main_py=${PY:-python3}
main_ver=$("$main_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)
in_ci=0
case "${CI:-}" in 1 | true | True | TRUE | yes) in_ci=1 ;; esac
status=0

for v in "$@"; do
    tag="== smoke CPython $v:"
    if [ "$v" = "$main_ver" ]; then
        echo "$tag skipped (the full suite runs on it)"
        continue
    fi
    if ! py=$(scripts/find_python.sh "$v"); then
        if [ "$v" = 3.10 ] && [ $in_ci = 1 ]; then
            echo "$tag FAILED: no CPython 3.10 found (python3.10 on PATH or under pyenv); CI must test the oldest supported Python" >&2
            status=1
        else
            echo "$tag skipped: no CPython $v found (python$v on PATH or under pyenv)"
        fi
        continue
    fi
    start=$SECONDS
    venv=.venv-smoke/$v
    target=target/smoke-$v
    mkdir -p "$target"
    if ! "$venv/bin/python" -c 'import maturin, numpy, cbor2, xxhash, msgspec, rich, pytest, hypothesis' 2>/dev/null; then
        echo "$tag creating $venv with $py, installing maturin, numpy, cbor2, xxhash, msgspec, rich, pytest, hypothesis"
        rm -rf "$venv"
        if ! { "$py" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip &&
            "$venv/bin/python" -m pip install -q maturin numpy cbor2 xxhash msgspec rich pytest hypothesis; }; then
            echo "$tag FAILED to create $venv" >&2
            status=1
            continue
        fi
    fi
    echo "$tag building the Rust core (cargo --release into $target; about a minute from scratch)"
    rm -rf "$target/wheels"
    if ! CARGO_TARGET_DIR=$target "$venv/bin/maturin" build --release -i "$venv/bin/python" -o "$target/wheels" \
        >"$target/build.log" 2>&1; then
        tail -40 "$target/build.log" >&2
        echo "$tag FAILED to build (log: $target/build.log)" >&2
        status=1
        continue
    fi
    "$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$target"/wheels/*.whl || { status=1; continue; }
    echo "$tag golden vectors, short lockstep, vLLM's trace replay, mixed prompts, kvblock replay"
    # the tests must import the installed wheel, not the checkout's sources
    if ! "$venv/bin/python" -c 'import kvblock, sys; f = kvblock.__file__; sys.exit(0 if "site-packages" in f else f"imports {f}")'; then
        status=1
        continue
    fi
    if ! KVBLOCK_LOCKSTEP_EXAMPLES=${KVBLOCK_SMOKE_EXAMPLES:-60} "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        tests/test_hashing_golden.py tests/test_pool_lockstep.py tests/test_manager_lockstep.py \
        tests/test_workload_replay.py tests/test_mixed_prompt.py tests/test_cpu_dispatch.py \
        --deselect tests/test_mixed_prompt.py::test_vllm_itself_where_installed; then
        echo "$tag FAILED (tests)" >&2
        status=1
        continue
    fi
    if ! (cd "$target" && "$OLDPWD/$venv/bin/python" -m kvblock replay --json >replay.json &&
        "$OLDPWD/$venv/bin/python" -c '
import json, sys
d = json.load(open("replay.json"))
hits = (d["prefix_cache"]["hits"], d["prefix_cache"]["queries"])
sys.exit(0 if hits == (1150464, 2048000) else f"kvblock replay: hits {hits}, expected (1150464, 2048000)")'); then
        echo "$tag FAILED (kvblock replay)" >&2
        status=1
        continue
    fi
    echo "$tag passed in $((SECONDS - start)) s"
done
exit $status
