"""Type checks of the public API, run by ``make test`` (and so by CI):

1. ``mypy --strict`` on every ``python`` code block of README.md and of the docs site's pages
   (``docs/*.md``; extracted as written, after
   a preamble that declares the names the examples take as given, such as ``token_ids``)
   and on the snippets under ``tests/typing/``;
2. ``python -m mypy.stubtest kvblock._core``: ``python/kvblock/_core.pyi`` against the
   compiled core.

Exit status 0 when both pass. Run it with the Python of the venv kvblock is installed in.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Names the README's examples use without defining them, with their types.
README_PREAMBLE = """\
from __future__ import annotations

token_ids: list[int]
prompt_token_ids: list[int]
next_token: int
block_hashes: list[bytes]
"""


def readme_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def doc_pages() -> list[Path]:
    """README.md, then the docs site's pages."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run(cmd: list[str], what: str) -> bool:
    print(f"== {what}: {' '.join(cmd[2:])}", flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode == 0


def main() -> int:
    pages = {page: readme_blocks(page.read_text()) for page in doc_pages()}
    if not pages[ROOT / "README.md"]:
        print("README.md has no python code blocks to check", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="kvblock-readme-") as tmp:
        files = []
        for page, blocks in pages.items():
            for i, block in enumerate(blocks):
                path = Path(tmp) / f"{page.stem.lower()}_example_{i + 1}.py"
                path.write_text(README_PREAMBLE + block)
                files.append(str(path))
        snippets = sorted(str(p) for p in (ROOT / "tests" / "typing").glob("*.py"))
        ok = run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", *files, *snippets],
                 f"mypy --strict on {len(files)} README and docs examples and {len(snippets)} tests/typing snippets")
    ok = run([sys.executable, "-m", "mypy.stubtest", "kvblock._core"], "stubtest") and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
