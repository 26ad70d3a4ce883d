"""``kvblock replay``: real request traces through a continuous-batching simulator.

* trace formats: :func:`load_trace` (Mooncake, Bailian, token-id JSONL) and the built-in
  workloads (:func:`builtin_workload`);
* the simulator: :class:`SimConfig`, :func:`replay`, :class:`Replayer`;
* results and reports: :class:`ReplayResult`, :mod:`kvblock.replay.report`;
* capacity sweeps and plots: :func:`kvblock.replay.sweep.sweep`,
  :func:`kvblock.replay.plot.plot_sweep` (matplotlib);
* the built-in ``apc-peer-v1`` workload and its end-to-end scheduler loop:
  :mod:`kvblock.replay.peer_workload` (the benchmarks' workload).
"""

from .backends import IMPLS, get_impl
from .config import SimConfig
from .errors import ReplayError, SettingError, TraceFormatError, UnservableRequestsError
from .loader import load_trace
from .result import ReplayResult, Unservable
from .simulator import Replayer, replay
from .trace import SchedulerDefaults, Trace, TraceRequest
from .workloads import WORKLOADS, builtin_workload

__all__ = [
    "IMPLS",
    "ReplayError",
    "SettingError",
    "ReplayResult",
    "Replayer",
    "SchedulerDefaults",
    "SimConfig",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "Unservable",
    "UnservableRequestsError",
    "WORKLOADS",
    "builtin_workload",
    "get_impl",
    "load_trace",
    "replay",
]
