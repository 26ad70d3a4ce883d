#!/usr/bin/env bash
# build_wheels.sh [X.Y ...]: portable manylinux wheels of kvblock for CPython 3.10-3.13 (or the
# versions given), built on this machine with maturin and zig (the `ziglang` package from
# PyPI links against glibc 2.17, manylinux2014), then checked:
#   1. `auditwheel show` (from PyPI) must find each wheel consistent with manylinux_2_17;
#   2. each wheel is installed into a fresh venv of its Python, in a temporary folder with no
#      access to the checkout's sources, and scripts/wheel_smoke.py runs there (python -I).
# Wheels go to dist/. The build tools live in .venv-wheels (made with $PY, default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.10 3.11 3.12 3.13)
PY=${PY:-python3}
tools=.venv-wheels
t0=$SECONDS
say() { echo "== wheels: $*"; }

if ! "$tools/bin/python" -c 'import maturin, ziglang, auditwheel' 2>/dev/null; then
    say "creating $tools with maturin, ziglang (the zig linker, ~50 MB) and auditwheel"
    rm -rf "$tools"
    "$PY" -m venv "$tools" && "$tools/bin/python" -m pip install -q --upgrade pip &&
        "$tools/bin/python" -m pip install -q "maturin>=1.5,<2" ziglang auditwheel || exit 1
fi

interpreters=()
for v in "${versions[@]}"; do
    if ! p=$(scripts/find_python.sh "$v"); then
        echo "== wheels: no CPython $v found (python$v on PATH or under pyenv): cannot build cp${v/./}" >&2
        exit 1
    fi
    interpreters+=("$p")
done

rm -rf dist
mkdir -p dist
for p in "${interpreters[@]}"; do
    v=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    say "building cp${v/./} (cargo --release, linked by zig for manylinux2014; about a minute each)"
    s=$SECONDS
    # maturin runs zig as `python3 -m ziglang`: the tools venv comes first on PATH
    if ! PATH="$PWD/$tools/bin:$PATH" CARGO_TARGET_DIR=target/wheels "$tools/bin/maturin" build --release --zig --compatibility manylinux2014 \
        -i "$p" -o dist >"dist/build-$v.log" 2>&1; then
        tail -40 "dist/build-$v.log" >&2
        echo "== wheels: build for $v FAILED (log: dist/build-$v.log)" >&2
        exit 1
    fi
    say "built $(cd dist && ls kvblock-*-cp${v/./}-*.whl) in $((SECONDS - s)) s"
done
rm -f dist/build-*.log

status=0
for whl in dist/*.whl; do
    name=$(basename "$whl")
    report=$("$tools/bin/auditwheel" show "$whl" 2>&1)
    # auditwheel wraps its lines: match on the text with the line breaks taken out
    if ! tr -s '\n ' '  ' <<<"$report" | grep -q 'consistent with the following platform tag: "manylinux_2_17_x86_64"'; then
        echo "$report" >&2
        echo "== wheels: $name is not manylinux_2_17 (auditwheel show above)" >&2
        status=1
    else
        say "auditwheel: $name is consistent with manylinux_2_17_x86_64"
    fi
done
[ $status = 0 ] || exit 1

for p in "${interpreters[@]}"; do
    v=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    whl=$(ls "$PWD"/dist/kvblock-*-cp${v/./}-*.whl)
    tmp=$(mktemp -d)
    cp scripts/wheel_smoke.py "$tmp/"
    s=$SECONDS
    say "cp${v/./}: fresh venv in $tmp, pip install $(basename "$whl") (its dependencies from PyPI), smoke test"
    if ! (cd "$tmp" && "$p" -m venv venv && venv/bin/python -m pip install -q "$whl" &&
        env -u PYTHONPATH venv/bin/python -I wheel_smoke.py); then
        echo "== wheels: cp${v/./} smoke test FAILED (in $tmp)" >&2
        status=1
        continue
    fi
    rm -rf "$tmp"
    say "cp${v/./}: passed in $((SECONDS - s)) s"
done
[ $status = 0 ] && say "done in $((SECONDS - t0)) s: $(ls dist | tr '\n' ' ')"
exit $status
