"""Optional dependencies: a clear error saying what to install when one is missing.

kvblock is not on PyPI, so ``pip install 'kvblock[extra]'`` cannot work, and
``pip install '.[extra]'`` from the checkout rebuilds the Rust core (minutes) to add one
Python package: the hint names the package to ``pip install`` directly, and the extra of
``pyproject.toml`` it belongs to.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError

#: What to ``pip install`` for a missing top-level module (the pins of pyproject.toml's extras).
PIP_PACKAGES: dict[str, str] = {
    "zmq": "pyzmq",
    "redis": "redis",
    "aiohttp": "aiohttp",
    "prometheus_client": "prometheus-client",
    "matplotlib": "matplotlib",
    "torch": "torch",
    "vllm": "'vllm>=0.32,<0.35'",
}


#: The extra of pyproject.toml each optional top-level module belongs to.
EXTRAS: dict[str, str] = {
    "zmq": "cluster",
    "redis": "cluster",
    "aiohttp": "cluster",
    "prometheus_client": "cluster",
    "matplotlib": "plot",
    "torch": "torch",
    "vllm": "vllm",
}


def missing_message(e: ModuleNotFoundError) -> str:
    """The message of ``e`` with the install hint added when ``e`` is a bare "No module named
    X" for an optional dependency ``X`` (an import that bypassed :func:`require`; a
    :class:`MissingExtraError` already carries the hint)."""
    msg = str(e)
    top = (e.name or "").partition(".")[0]
    if top in EXTRAS and not isinstance(e, MissingExtraError):
        return f"{msg}: {install_hint(top, EXTRAS[top])}"
    return msg


def install_hint(module: str, extra: str) -> str:
    """``pip install PACKAGE (kvblock's 'EXTRA' extra)`` for the top-level ``module``."""
    return f"pip install {PIP_PACKAGES.get(module, module)} (kvblock's '{extra}' extra)"


def require(module: str, *, package: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` (a top-level package), or raise ``ModuleNotFoundError`` saying what
    needs it and how to install it (:func:`install_hint`). An import error raised *inside* an
    installed ``module`` passes through unchanged.

    Raises:
        MissingExtraError: ``module`` is not installed (a ``ModuleNotFoundError`` whose
            ``name`` is ``module``).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise MissingExtraError(
            f"{what} needs {package}, which is not installed: {install_hint(module, extra)}",
            name=module,
        ) from e


def require_all(modules: list[str], *, extra: str, what: str) -> list[ModuleType]:
    """Import every top-level module of ``modules`` (all of ``extra``'s that ``what`` needs),
    or raise one ``ModuleNotFoundError`` naming every one that is missing and the one
    ``pip install`` of them all (so a user does not meet them one at a time).

    Raises:
        MissingExtraError: some of ``modules`` are not installed (``name`` is the first).
    """
    out, missing = [], []
    for module in modules:
        try:
            out.append(importlib.import_module(module))
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            missing.append(module)
    if missing:
        packages = [PIP_PACKAGES.get(m, m) for m in missing]
        names = " and ".join([", ".join(packages[:-1]), packages[-1]]) if len(packages) > 1 else packages[0]
        verb = "are" if len(packages) > 1 else "is"
        raise MissingExtraError(
            f"{what} needs {names}, which {verb} not installed: pip install {' '.join(packages)} "
            f"(kvblock's '{extra}' extra)",
            name=missing[0],
        )
    return out
