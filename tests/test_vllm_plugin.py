"""kvblock.vllm as vLLM 0.33.0 sees it: the API matches the installed vLLM's (drift), the
plugin entry point is found and run by vLLM's own plugin loader, unsupported configurations
fall back with one warning (or raise in strict mode), and a scheduler built through
``EngineArgs(scheduler_cls="kvblock.vllm.Scheduler")`` runs requests on kvblock's manager."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from conftest import REPO, require_module

vllm = require_module("vllm")

import torch  # noqa: E402
from vllm.v1.core import block_pool as vbp  # noqa: E402
from vllm.v1.core import kv_cache_coordinator as vkc  # noqa: E402
from vllm.v1.core import kv_cache_manager as vkm  # noqa: E402
from vllm.v1.core import single_type_kv_cache_manager as vst  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

import kvblock.vllm as kv  # noqa: E402
from kvblock import block_pool as kbp  # noqa: E402
from kvblock.vllm import block_pool as kvbp  # noqa: E402
from kvblock.vllm import blocks as kb  # noqa: E402
from kvblock.vllm import coordinator as kc  # noqa: E402
from kvblock.vllm.manager import VllmKVCacheManager  # noqa: E402
from kvblock.vllm.originals import original  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _params(fn) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter but the receiver; positional-only and
    positional-or-keyword are the same to a caller passing positionals or names after self."""
    sig = inspect.signature(fn)
    out = []
    for i, p in enumerate(sig.parameters.values()):
        if i == 0 and p.name == "self":
            continue
        kind = "positional" if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else p.kind.name
        out.append((p.name, kind, p.default))
    return out


def _public_methods(cls: type) -> list[str]:
    names = []
    for name, member in vars(cls).items():
        if name.startswith("_") or isinstance(member, property):
            continue
        if callable(member) or isinstance(member, (staticmethod, classmethod)):
            names.append(name)
    return names


DRIFT_PAIRS = [
    (vkm.KVCacheManager, kv.KVCacheManager),
    (vbp.BlockPool, kvbp.BlockPool),
    (vkm.KVCacheBlocks, kb.KVCacheBlocks),
    (vbp.BlockHashToBlockMap, kvbp.BlockHashToBlockMap),
    (vkc.KVCacheCoordinator, kc.UnitaryCoordinatorView),
    (vkc.UnitaryKVCacheCoordinator, kc.UnitaryCoordinatorView),
    (vkc.HybridKVCacheCoordinator, kc.HybridCoordinatorView),
    (vkc.KVCacheCoordinatorNoPrefixCache, kc.NoPrefixCacheCoordinatorView),
    (vst.SingleTypeKVCacheManager, kc.SingleTypeManagerView),
]


#: Methods of vLLM's per-type manager that only vLLM's own coordinator calls, inside the
#: allocate / cache / free flow that kvblock's Rust coordinator runs instead: the view does not
#: offer them (vLLM's scheduler, engine core and connectors read a per-type manager's
#: block_size, kv_cache_spec, block_pool and req_to_blocks, and tests call the rest).
COORDINATOR_ONLY = {
    vst.SingleTypeKVCacheManager: {
        "add_local_computed_blocks",
        "allocate_external_computed_blocks",
        "reachable_block_mask",
        "pop_blocks_for_free",
        "new_step_starts",
    },
}


@pytest.mark.parametrize("vllm_cls,ours", DRIFT_PAIRS, ids=lambda c: c.__qualname__)
def test_signatures_match_installed_vllm(vllm_cls, ours):
    """Every public method of the vLLM class exists on kvblock's with the same parameters
    (names, order, kinds, defaults), so a vLLM upgrade that changes one fails here."""
    missing, different = [], []
    skipped = COORDINATOR_ONLY.get(vllm_cls, set())
    assert skipped <= set(_public_methods(vllm_cls)), "COORDINATOR_ONLY names a method vLLM no longer has"
    for name in _public_methods(vllm_cls):
        mine = getattr(ours, name, None)
        if name in skipped:
            assert mine is None, f"{name} is implemented now: drop it from COORDINATOR_ONLY"
            continue
        if mine is None:
            missing.append(name)
            continue
        theirs = getattr(vllm_cls, name)
        if _params(theirs) != _params(mine):
            different.append(f"{name}: vLLM {inspect.signature(theirs)} != kvblock {inspect.signature(mine)}")
    assert not missing, f"{vllm_cls.__qualname__} methods kvblock lacks: {missing}"
    assert not different, "\n".join(different)


def test_constructors_match_installed_vllm():
    assert _params(kv.KVCacheManager) == _params(vkm.KVCacheManager)
    assert _params(kvbp.BlockPool) == _params(vbp.BlockPool)
    assert _params(kb.KVCacheBlocks) == _params(vkm.KVCacheBlocks)


def test_constructors_take_the_installed_releases_positions():
    """Every argument passed by position lands where the installed release puts it (0.32 has
    no num_hash_lookahead_tokens, so its later positions differ from 0.33's)."""
    names = [p for p in inspect.signature(vbp.BlockPool).parameters]
    values = {"num_gpu_blocks": 8, "enable_caching": True, "hash_block_size": 16, "enable_kv_cache_events": True,
              "metrics_collector": None, "num_hash_lookahead_tokens": 2, "medium": "CPU"}
    pool = kvbp.BlockPool(*[values[n] for n in names])
    assert (pool.num_gpu_blocks, pool.medium) == (8, "CPU")
    assert pool.num_hash_lookahead_tokens == (2 if "num_hash_lookahead_tokens" in names else 0)
    with pytest.raises(TypeError):
        kvbp.BlockPool(*[values[n] for n in names], "extra")
    mnames = list(inspect.signature(vkm.KVCacheManager).parameters)
    margs = {"kv_cache_config": _config([_full()], 64), "max_model_len": 256, "scheduler_block_size": 16,
             "hash_block_size": 16, "max_in_flight_tokens": None, "enable_caching": True, "use_eagle": False,
             "num_hash_lookahead_tokens": 0, "num_prefill_lookahead": 0, "log_stats": True,
             "enable_kv_cache_events": True, "dcp_world_size": 1, "pcp_world_size": 1}
    mgr = kv.KVCacheManager(*[margs[n] for n in mnames if n in margs][: len(margs)])
    assert type(mgr) is kv.KVCacheManager and mgr.log_stats and mgr.enable_kv_cache_events


def test_attributes_vllm_reads_are_there():
    mgr = kv.KVCacheManager(_config([_full()], 64), 256, 16, 16, enable_kv_cache_events=True, log_stats=True)
    for attr in ("block_pool", "coordinator", "kv_cache_config", "num_kv_cache_groups", "enable_caching",
                 "log_stats", "prefix_cache_stats", "empty_kv_cache_blocks", "max_model_len", "usage"):
        assert hasattr(mgr, attr), attr
    pool = mgr.block_pool
    assert pool.blocks[0] is pool.null_block and pool.null_block.is_null
    assert pool.free_block_queue.num_free_blocks == 63 == len(pool.free_block_queue.get_all_free_blocks())
    stm = mgr.coordinator.single_type_managers[0]
    assert stm.block_size == 16 and isinstance(stm.kv_cache_spec, FullAttentionSpec)
    assert dict(stm.req_to_blocks) == {}


def _full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _config(specs, num_blocks: int) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def test_describe_names_the_path():
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=128)
    assert str(kv.describe(_config([_full(), sw], 64))) == "kvblock"
    mamba = MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    # every release's Mamba prefix caching, 0.32's "none" groups that cache included
    assert kv.describe(_config([_full(), mamba], 64)).on_kvblock
    assert kv.describe(_config([_full(), replace(mamba, mamba_cache_mode="none")], 64)).on_kvblock
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    # residency metrics run on kvblock (tests/test_vllm_metrics.py); a collector whose hooks
    # are Python code of its own runs on vLLM's manager, with the reason
    assert kv.describe(_config([_full()], 64), metrics_collector=KVCacheMetricsCollector()).on_kvblock
    path = kv.describe(_config([_full()], 64), metrics_collector=_own_hooks_class()())
    assert not path.on_kvblock and "metrics_collector" in path.reason
    assert str(path).startswith("vLLM's own manager: ")


def _own_hooks_class():
    """A collector subclass with a Python hook of its own (kvblock hands it to vLLM's manager)."""
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    class OwnHooks(KVCacheMetricsCollector):
        def on_block_accessed(self, block) -> None:
            super().on_block_accessed(block)

    return OwnHooks


def test_fallback_warns_once_and_strict_raises(monkeypatch):
    from kvblock.vllm import manager as km

    KVCacheMetricsCollector = _own_hooks_class()

    monkeypatch.setattr(km, "_warned", set())
    monkeypatch.delenv("KVBLOCK_VLLM_STRICT", raising=False)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.DEBUG)
    km.logger.addHandler(keep)
    try:
        a = kv.KVCacheManager(_config([_full()], 64), 256, 16, 16, metrics_collector=KVCacheMetricsCollector())
        b = kv.KVCacheManager(_config([_full()], 64), 256, 16, 16, metrics_collector=KVCacheMetricsCollector())
    finally:
        km.logger.removeHandler(keep)
    assert type(a) is VllmKVCacheManager and type(b) is VllmKVCacheManager
    lines = [(r.levelname, r.getMessage()) for r in records]
    assert len(lines) == 1 and lines[0][0] == "WARNING" and "metrics_collector" in lines[0][1], lines
    # printed the way vLLM prints its own warnings (its handlers and format, the level named),
    # in a process whose logging vLLM configured, as its engine does at start-up
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector as C\n"
        "class KVCacheMetricsCollector(C):\n"
        "    def on_block_accessed(self, block): super().on_block_accessed(block)\n"
        "from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "import kvblock.vllm as kv\n"
        "configure_logging(LoggingConfig())\n"
        "spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)\n"
        "cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(['l'], spec)])\n"
        "kv.KVCacheManager(cfg, 256, 16, 16, metrics_collector=KVCacheMetricsCollector())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    printed = [line for line in (out.stdout + out.stderr).splitlines() if "using vLLM's own KV cache manager" in line]
    assert len(printed) == 1 and "WARNING" in printed[0] and "metrics_collector" in printed[0], printed
    monkeypatch.setenv("KVBLOCK_VLLM_STRICT", "1")
    with pytest.raises(kv.UnsupportedConfiguration, match="metrics_collector"):
        kv.KVCacheManager(_config([_full()], 64), 256, 16, 16, metrics_collector=KVCacheMetricsCollector())
    # a supported configuration is on kvblock in strict mode too
    assert isinstance(kv.KVCacheManager(_config([_full()], 64), 256, 16, 16), kv.KVCacheManager)


def test_release_window():
    from kvblock.vllm import releases

    assert releases.WINDOW == ("0.32", "0.33", "0.34")
    assert releases.release_of("0.32.0+cpu").series == "0.32"
    assert releases.release_of("0.34.2").hit_limit_field == "prefix_cache_hit_limit"
    assert releases.release_of("0.33.1").hit_limit_field == "skip_reading_prefix_cache"
    for outside in ("0.31.9", "0.35.0", "1.0.0", "unknown"):
        with pytest.raises(releases.UnsupportedVllmRelease, match=r"supports vLLM 0\.32\.x, 0\.33\.x and 0\.34\.x; the installed vLLM is "):
            releases.release_of(outside)
    assert issubclass(releases.UnsupportedVllmRelease, RuntimeError)
    assert releases.current().series == vllm.__version__.rsplit(".", 1)[0]


@pytest.mark.parametrize(
    "route",
    [
        "import kvblock.vllm",
        "from kvblock.vllm import Scheduler",
        "from kvblock.vllm import patch; patch()",
        "import kvblock.vllm.testing",
    ],
)
def test_release_outside_window_is_refused_before_engine_state(route):
    # every route into kvblock.vllm imports the package first, which checks the release
    out = _run(f"""
        import vllm
        vllm.__version__ = "0.35.0"
        try:
            {route}
        except RuntimeError as e:
            print(type(e).__name__, e)
        else:
            print("accepted")
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("UnsupportedVllmRelease kvblock "), out.stdout
    assert "supports vLLM 0.32.x, 0.33.x and 0.34.x; the installed vLLM is 0.35.0" in out.stdout


def test_plugin_entry_point_is_silent_when_off_outside_window():
    # vLLM loads the entry point in every process: with kvblock off it imports nothing of
    # kvblock.vllm, so a vLLM outside the window is not refused (nor noisy) there
    out = _run("""
        import sys, vllm
        vllm.__version__ = "0.35.0"
        from kvblock.vllm_plugin import register
        register()
        print("kvblock.vllm" in sys.modules)
        """)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    on = _run("""
        import vllm
        vllm.__version__ = "0.35.0"
        from kvblock.vllm_plugin import register
        try:
            register()
        except RuntimeError as e:
            print(type(e).__name__)
        """, KVBLOCK_VLLM="1")
    assert on.stdout.strip() == "UnsupportedVllmRelease", on.stderr


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    for k in ("KVBLOCK_VLLM", "KVBLOCK_VLLM_STRICT"):
        full.pop(k, None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=300)


def test_import_kvblock_never_imports_vllm():
    r = _run("""
        import sys
        import kvblock, kvblock.manager, kvblock.block_pool, kvblock.cli, kvblock.specs, kvblock.hashing
        assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")], "vllm imported"
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_entry_point_is_loaded_by_vllm_and_gated_on_env():
    """vLLM's own plugin loader finds kvblock's ``vllm.general_plugins`` entry point; it
    swaps kvblock in only with KVBLOCK_VLLM=1, idempotently."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvblock"]
    assert [ep.value for ep in eps] == ["kvblock.vllm_plugin:register"]
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.v1.core.kv_cache_manager as vkm, vllm.v1.core.block_pool as vbp
        import vllm.v1.core.kv_cache_utils as vku, vllm.utils.hashing as vh
        from kvblock.vllm import is_patched, register
        register(); register()
        print(is_patched(), vkm.KVCacheManager.__module__, vbp.BlockPool.__module__, vku.get_request_block_hasher.__module__)
        from kvblock.vllm import unpatch
        unpatch()
        print(is_patched(), vkm.KVCacheManager.__module__)
    """
    on = _run(code, KVBLOCK_VLLM="1")
    assert on.returncode == 0, on.stderr[-3000:]
    first, second = on.stdout.strip().splitlines()[-2:]
    assert first.split()[0] == "True" and "kvblock" in first.split()[1] and "kvblock" in first.split()[2]
    assert "kvblock" in first.split()[3]
    assert second == "False vllm.v1.core.kv_cache_manager"
    off = _run(code)
    assert off.returncode == 0, off.stderr[-3000:]
    assert off.stdout.strip().splitlines()[-2].split()[:2] == ["False", "vllm.v1.core.kv_cache_manager"]


def test_engine_args_scheduler_cls_runs_on_kvblock():
    """EngineArgs(scheduler_cls="kvblock.vllm.Scheduler") -> VllmConfig -> the scheduler class
    vLLM's engine core resolves; its manager is kvblock's, and two requests sharing a prefix
    run to completion through schedule() / update_from_output() with the second one hitting
    the first one's cached blocks."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from kvblock.vllm.releases import model_runner_output
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    args = EngineArgs(model="facebook/opt-125m", scheduler_cls="kvblock.vllm.Scheduler", enable_prefix_caching=True,
                      block_size=16, max_model_len=1024, skip_tokenizer_init=True)
    cfg = args.create_engine_config()
    scheduler_cls = cfg.scheduler_config.get_scheduler_cls()
    assert scheduler_cls is kv.Scheduler
    register_all_kvcache_specs(cfg)
    kv_cache_config = _config([_full(16)], 200)
    cfg.cache_config.num_gpu_blocks = 200
    sched = scheduler_cls(vllm_config=cfg, kv_cache_config=kv_cache_config, block_size=16, log_stats=True,
                          structured_output_manager=StructuredOutputManager(cfg))
    assert type(sched.kv_cache_manager) is kv.KVCacheManager
    # the scheduler vLLM itself picks for the configuration: on CPU vLLM turns async
    # scheduling off, and its default is then the synchronous Scheduler
    assert cfg.scheduler_config.async_scheduling is False
    assert type(sched) is kv.SyncScheduler

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    prefix = list(range(100, 164))
    finished: list[str] = []
    for i, tail in enumerate(([1, 2, 3], [4, 5, 6, 7, 8])):
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        params.update_from_generation_config({}, 2)
        req = Request(request_id=f"r{i}", prompt_token_ids=prefix + tail, sampling_params=params, pooling_params=None,
                      block_hasher=hasher)
        sched.add_request(req)
        while sched.has_unfinished_requests():
            out = sched.schedule()
            if i == 1 and "r1" in out.num_scheduled_tokens and out.scheduled_new_reqs:
                new = out.scheduled_new_reqs[0]
                assert new.num_computed_tokens == 64  # four 16-token blocks of r0's prompt
            ids = list(out.num_scheduled_tokens)
            mro = model_runner_output(ids, [[7] for _ in ids])
            for eco in sched.update_from_output(out, mro).values():
                finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
    assert finished == ["r0", "r1"]
    stats = sched.kv_cache_manager.block_pool
    assert stats.get_num_free_blocks() == 199  # everything back in the free queue, cached


def test_scheduler_is_the_one_vllm_picks_for_async_scheduling():
    """kvblock.vllm.Scheduler builds vLLM's AsyncScheduler with async scheduling on and vLLM's
    synchronous Scheduler with it off (vLLM's own choice, SchedulerConfig.get_scheduler_cls with
    no scheduler_cls), each on kvblock's manager; a subclass is built as itself."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = EngineArgs(model="facebook/opt-125m", enable_prefix_caching=True, block_size=16, max_model_len=1024,
                     skip_tokenizer_init=True).create_engine_config()
    register_all_kvcache_specs(cfg)
    cfg.cache_config.num_gpu_blocks = 64

    class Mine(kv.Scheduler):
        pass

    for async_on, vllm_base, ours in ((True, AsyncScheduler, kv.Scheduler), (False, VllmScheduler, kv.SyncScheduler)):
        cfg.scheduler_config.async_scheduling = async_on
        cfg.scheduler_config.scheduler_cls = None
        assert cfg.scheduler_config.get_scheduler_cls() is vllm_base
        for how in ("keyword", "positional"):
            kw = dict(kv_cache_config=_config([_full(16)], 64), block_size=16,
                      structured_output_manager=StructuredOutputManager(cfg))
            sched = kv.Scheduler(vllm_config=cfg, **kw) if how == "keyword" else kv.Scheduler(cfg, **kw)
            assert type(sched) is ours and isinstance(sched, vllm_base), (async_on, how)
            assert type(sched.kv_cache_manager) is kv.KVCacheManager
        mine = Mine(vllm_config=cfg, kv_cache_config=_config([_full(16)], 64), block_size=16,
                    structured_output_manager=StructuredOutputManager(cfg))
        assert type(mine) is Mine and type(mine.kv_cache_manager) is kv.KVCacheManager


def test_readme_scheduler_demo_runs_on_kvblock():
    """The README's by-hand check (scripts/vllm_scheduler_demo.py), run as a user runs it:
    vLLM's scheduler made from EngineArgs(scheduler_cls=...) reports kvblock's manager, and
    every request after the first hits the 96-token system prompt."""
    import subprocess
    import sys
    from pathlib import Path

    from vllm.triton_utils import HAS_TRITON

    if vllm.__version__.startswith("0.34.") and not HAS_TRITON:
        # a user script runs outside the test harness that lets 0.34 build a VllmConfig here
        pytest.skip("vLLM 0.34 refuses to build a VllmConfig on an x86 CPU without triton-cpu (shared/vllm/README.md)")
    script = Path(__file__).resolve().parent.parent / "scripts" / "vllm_scheduler_demo.py"
    out = subprocess.run([sys.executable, str(script), "--requests", "3"], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    assert "KV cache manager: kvblock.vllm.manager.KVCacheManager" in out
    assert "path: kvblock" in out
    assert "req-0: 116 prompt tokens, prefix-cache hit 0 tokens, 8 tokens generated" in out
    assert "req-1: 117 prompt tokens, prefix-cache hit 96 tokens, 8 tokens generated" in out
    assert "req-2: 118 prompt tokens, prefix-cache hit 96 tokens, 8 tokens generated" in out
    assert "free blocks at the end: 255 of 255" in out


@pytest.mark.parametrize("value, on", [("", False), ("0", False), ("false", False), ("No", False), ("off", False),
                                       ("1", True), ("true", True), ("YES", True), ("on", True)])
def test_switches_read_like_booleans(monkeypatch, value, on):
    """KVBLOCK_VLLM / KVBLOCK_VLLM_STRICT: "false" or "no" turn kvblock off (they turned it on
    when only "" and "0" were off)."""
    from kvblock.vllm.config import env_flag

    monkeypatch.setenv("KVBLOCK_VLLM", value)
    assert env_flag("KVBLOCK_VLLM") is on


def test_a_switch_that_is_neither_on_nor_off_is_refused(monkeypatch):
    from kvblock.vllm import plugin

    monkeypatch.setenv("KVBLOCK_VLLM", "maybe")
    before = plugin.is_patched()
    with pytest.raises(ValueError, match=r"KVBLOCK_VLLM='maybe': expected 1/true/yes/on or 0/false/no/off"):
        plugin.register()
    assert plugin.is_patched() == before
    monkeypatch.setenv("KVBLOCK_VLLM", "false")
    plugin.register()
    assert plugin.is_patched() == before


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_an_empty_pool_is_vllms_assertion(num_blocks):
    """vLLM's BlockPool asserts a positive block count: kvblock.vllm raises the same type
    (kvblock's own pool raises ValueError)."""
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    with pytest.raises(AssertionError):
        VllmBlockPool(num_blocks, True, 16)
    with pytest.raises(AssertionError, match="num_gpu_blocks: must be a positive int"):
        kv.BlockPool(num_blocks, True, 16)
    with pytest.raises(AssertionError, match="num_gpu_blocks"):
        kv.KVCacheManager(_config([_full()], num_blocks), 256, 16, 16)


@pytest.mark.parametrize("evict_first", [False, True])
def test_free_blocks_forwards_blocks_of_vllms_own_pool(evict_first):
    """Deferred frees may mix pools (vLLM forwards another pool's blocks to it): a block of
    vLLM's own pool (0.34: it holds that pool through a weakref) goes back to that pool, with
    0.34's evict_first passed on."""
    theirs = original(vbp, "BlockPool")(4, True, 16)
    ours = kvbp.BlockPool(4, True, 16)
    (block,) = theirs.get_new_blocks(1)
    free_before = theirs.get_num_free_blocks()
    kwargs = {"evict_first": evict_first} if "evict_first" in inspect.signature(theirs.free_blocks).parameters else {}
    if evict_first and not kwargs:
        pytest.skip("this vLLM has no evict_first")
    ours.free_blocks([block], **kwargs)
    assert block.ref_cnt == 0 and theirs.get_num_free_blocks() == free_before + 1
    assert ours.get_num_free_blocks() == 3
