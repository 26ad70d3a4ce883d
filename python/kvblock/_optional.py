"""Optional dependencies: a clear error naming the pip extra when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, *, package: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` (a top-level package), or raise ``ModuleNotFoundError`` saying what
    needs it and how to install it (``pip install 'kvblock[extra]'``). An import error raised
    *inside* an installed ``module`` passes through unchanged.

    Raises:
        ModuleNotFoundError: ``module`` is not installed (``name`` is ``module``).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ModuleNotFoundError(
            f"{what} needs {package}, which is not installed: pip install 'kvblock[{extra}]' "
            f"(or pip install '.[{extra}]' from a kvblock checkout)",
            name=module,
        ) from e
