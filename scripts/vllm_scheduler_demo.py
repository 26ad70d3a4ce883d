"""vLLM 0.33.0's scheduler on kvblock's KV cache manager, by hand, without a model or a GPU.

Builds a ``VllmConfig`` through ``EngineArgs(..., scheduler_cls="kvblock.vllm.Scheduler")``,
makes the scheduler vLLM's engine core would make from it, and runs requests that share a
system prompt through ``schedule()`` / ``update_from_output()`` (the model's outputs are
fake: one token per request per step). Prints the manager's class, the path
``kvblock.vllm.describe`` gives the configuration, and each request's prefix-cache hit.

Usage: ``python scripts/vllm_scheduler_demo.py [--model ORG/NAME] [--requests N]``. It needs
vLLM 0.33.0 (``make install`` puts it in ``.venv``). Offline machines: when ``HF_HOME`` is not
set and ``shared/vllm/hf-configs`` is found (``KVBLOCK_SHARED`` or ``../shared``), the
model's config is read from an offline Hugging Face cache laid from there.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def offline_setup() -> None:
    """vLLM on CPU, and an offline HF cache of the shared configs where one is needed."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if "HF_HOME" in os.environ:
        return
    shared = Path(os.environ.get("KVBLOCK_SHARED", REPO.parent / "shared"))
    if not (shared / "vllm" / "hf-configs").is_dir():
        return
    sys.path.insert(0, str(REPO / "tests" / "vllm_judge"))
    import judge

    home = judge.lay_hf_cache(Path(tempfile.mkdtemp(prefix="kvblock-hf-")), shared / "vllm" / "hf-configs")
    os.environ.update(judge.offline_env(home))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="facebook/opt-125m")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=256)
    args = ap.parse_args(argv)
    offline_setup()

    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from kvblock.vllm.releases import model_runner_output
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    import kvblock.vllm

    block_size = 16
    engine_args = EngineArgs(model=args.model, scheduler_cls="kvblock.vllm.Scheduler", enable_prefix_caching=True,
                             block_size=block_size, max_model_len=2048, skip_tokenizer_init=True)
    try:
        cfg = engine_args.create_engine_config()
    except OSError as e:  # the model's config.json is neither cached nor downloadable
        print(f"error: cannot read the config of {args.model} ({type(e).__name__}). Offline, point "
              "KVBLOCK_SHARED at the folder holding vllm/hf-configs (the shared reference data), or give "
              "--model a model whose config is in your Hugging Face cache.", file=sys.stderr)
        return 2
    register_all_kvcache_specs(cfg)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=12, head_size=64, dtype=cfg.model_config.dtype)
    kv_cache_config = KVCacheConfig(num_blocks=args.num_blocks,
                                    kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    cfg.cache_config.num_gpu_blocks = args.num_blocks
    scheduler_cls = cfg.scheduler_config.get_scheduler_cls()
    sched = scheduler_cls(vllm_config=cfg, kv_cache_config=kv_cache_config, block_size=block_size, log_stats=True,
                          structured_output_manager=StructuredOutputManager(cfg))
    manager = sched.kv_cache_manager
    print(f"scheduler: {scheduler_cls.__module__}.{scheduler_cls.__qualname__}")
    print(f"KV cache manager: {type(manager).__module__}.{type(manager).__qualname__}")
    print(f"path: {kvblock.vllm.describe(kv_cache_config)}")

    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    system_prompt = list(range(1000, 1000 + 6 * block_size))  # 96 tokens, six blocks
    for i in range(args.requests):
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        params.update_from_generation_config({}, 2)
        question = [5000 + 37 * i + j for j in range(20 + i)]
        req = Request(request_id=f"req-{i}", prompt_token_ids=system_prompt + question, sampling_params=params,
                      pooling_params=None, block_hasher=hasher)
        sched.add_request(req)
        hit = None
        while sched.has_unfinished_requests():
            out = sched.schedule()
            for new in out.scheduled_new_reqs:
                hit = new.num_computed_tokens
            ids = list(out.num_scheduled_tokens)
            mro = model_runner_output(ids, [[7] for _ in ids])
            sched.update_from_output(out, mro)
        print(f"{req.request_id}: {req.num_prompt_tokens} prompt tokens, prefix-cache hit {hit} tokens, "
              f"{req.num_output_tokens} tokens generated")
    pool = manager.block_pool
    print(f"free blocks at the end: {pool.get_num_free_blocks()} of {pool.num_gpu_blocks - 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
