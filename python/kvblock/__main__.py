"""``python -m kvblock``: the ``kvblock`` command. Ctrl-C while the command's modules are
still importing ends it as Ctrl-C later does: ``kvblock: interrupted``, exit status 130."""

import sys


def _run() -> int:
    try:
        from .cli import main
    except KeyboardInterrupt:
        print("kvblock: interrupted", file=sys.stderr)
        return 130
    return main()


sys.exit(_run())
