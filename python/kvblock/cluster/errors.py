"""Errors of :mod:`kvblock.cluster`."""

from __future__ import annotations

__all__ = ["IndexUnavailable"]


class IndexUnavailable(RuntimeError):
    """The shared index cannot be reached (Redis down, restarting, timing out). The router
    routes by load alone while it is raised, and the writer resynchronises afterwards."""
