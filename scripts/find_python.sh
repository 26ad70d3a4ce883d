#!/usr/bin/env bash
# find_python.sh X.Y: print the path of a working CPython X.Y interpreter, or exit 1.
# Looks, in order, at python X.Y on PATH (a pyenv shim that is not active for this version
# does not count), then under pyenv's versions, then /usr/bin and /usr/local/bin.
set -uo pipefail
want="$1"

works() {
    [ -n "$1" ] && [ -x "$1" ] &&
        [ "$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$want" ] &&
        "$1" -c 'import venv, ensurepip' 2>/dev/null
}

candidates=()
c=$(command -v "python$want" 2>/dev/null) && candidates+=("$c")
root=""
if command -v pyenv >/dev/null 2>&1; then
    root=$(pyenv root 2>/dev/null)
fi
root=${root:-${PYENV_ROOT:-$HOME/.pyenv}}
if [ -d "$root/versions" ]; then
    # newest patch release first
    while IFS= read -r d; do
        candidates+=("$d/bin/python$want")
    done < <(find "$root/versions" -maxdepth 1 -name "$want.*" 2>/dev/null | sort -rV)
fi
candidates+=("/usr/local/bin/python$want" "/usr/bin/python$want")

for c in "${candidates[@]}"; do
    if works "$c"; then
        # a pyenv shim resolves to the real interpreter for the venv
        "$c" -c 'import sys; print(sys.executable)'
        exit 0
    fi
done
exit 1
