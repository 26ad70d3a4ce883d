"""Run one test in an interpreter of its own, for the derandomized Hypothesis state machines
whose coverage checks must see the same examples every run.

``derandomize=True`` fixes Hypothesis's seed, but not its examples: Hypothesis (6.13x and
later) also draws constants it collects from the *local* modules in ``sys.modules`` (the
repository's own code, kvblock's modules included), so what ran before in the same pytest
process changes the examples. After a ``kvblock replay`` in the same process, the HiSparse
manager lockstep's examples reached other paths (127 refused allocations instead of 25, never
"not all resident") and its coverage check failed, while vLLM and kvblock agreed at every step.
In a fresh interpreter the loaded modules, and so the examples, are the same every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: Set, to the test's node id, in the interpreter running it.
_CHILD = "KVBLOCK_FRESH_INTERPRETER"
REPO = Path(__file__).resolve().parent.parent


def run_alone(test_file: str, test_name: str, timeout_s: int = 1200) -> bool:
    """In the pytest process: run ``test_file::test_name`` in a fresh interpreter (the same
    Python, environment and vLLM CPU harness plugin), assert it passed, and return True (the
    caller then returns). In that fresh interpreter: return False (the caller runs its body)."""
    node = f"{Path(test_file).resolve()}::{test_name}"
    if os.environ.get(_CHILD) == node:
        return False
    plugins = ["-p", "triton_shim"] if "triton_shim" in sys.modules else []
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, node],
                       env={**os.environ, _CHILD: node}, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "1 passed" in r.stdout, r.stdout[-3000:]
    return True
