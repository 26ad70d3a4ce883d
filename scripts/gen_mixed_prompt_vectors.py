"""Record vLLM 0.33.0's block hashes of mixed prompts (``prompt_is_token_ids``) into
``tests/data/mixed_prompt_vectors.json``, from vLLM's own ``Request`` and request block
hasher, for the four hash algorithms.

Run where vLLM 0.33.0 is installed (with torch): ``python scripts/gen_mixed_prompt_vectors.py``.
``tests/test_mixed_prompt.py`` checks kvblock and the reference against the file (everywhere)
and against vLLM itself (where it is installed).
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "mixed_prompt_vectors.json"
#: PYTHONHASHSEED while hashing: the NONE_HASH seed of every algorithm (xxhash's is random
#: without it).
SEED = "20260"
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def cases() -> list[dict]:
    """Prompts of several shapes: interleaved runs of token ids and embedding rows, all
    embeddings, a mask without prompt_embeds, with a LoRA / salt, outputs appended."""
    import numpy as np

    rng = np.random.default_rng(13)
    out = []
    for name, n, bs, dtype, with_embeds, extra, outputs in [
        ("interleaved", 37, 4, "float32", True, {}, [1, 2, 3, 4, 5]),
        ("block16", 70, 16, "float16", True, {}, [7] * 11),
        ("block1", 9, 1, "float32", True, {}, [3]),
        ("all-embeds", 12, 4, "float32", True, {}, []),
        ("mask-only", 20, 4, None, False, {}, [9, 9]),
        ("lora-salt", 24, 4, "float32", True, {"lora": ["ad", 3, "/ad"], "cache_salt": "s1"}, [5, 6, 7]),
    ]:
        toks = [int(x) for x in rng.integers(0, 151_000, n)]
        if name == "all-embeds":
            mask = [False] * n
        else:
            mask = [bool(x) for x in rng.random(n) > 0.45]
        # placeholder ids where the input is an embedding: vLLM's sentinel, not hashed
        toks = [t if m else 151_655 for t, m in zip(toks, mask)]
        case = {"name": name, "block_size": bs, "prompt_token_ids": toks, "prompt_is_token_ids": mask,
                "output_token_ids": outputs, **extra}
        if with_embeds:
            arr = rng.standard_normal((n, 6)).astype(dtype)
            case["prompt_embeds"] = {"dtype": dtype, "shape": list(arr.shape),
                                     "data": base64.b64encode(arr.tobytes()).decode()}
        out.append(case)
    return out


def embeds_of(case: dict):
    import numpy as np

    e = case.get("prompt_embeds")
    if e is None:
        return None
    return np.frombuffer(base64.b64decode(e["data"]), dtype=e["dtype"]).reshape(e["shape"]).copy()


def vllm_hashes(case: dict, algo: str) -> list[str]:
    """The case's block hashes by vLLM 0.33.0: its Request (mixed prompt), its hasher."""
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    emb = embeds_of(case)
    lora = LoRARequest(*case["lora"]) if "lora" in case else None
    req = Request(
        "r", list(case["prompt_token_ids"]), SamplingParams(max_tokens=64), None,
        prompt_embeds=None if emb is None else torch.from_numpy(emb),
        prompt_is_token_ids=list(case["prompt_is_token_ids"]), lora_request=lora,
        cache_salt=case.get("cache_salt"),
        block_hasher=kv_cache_utils.get_request_block_hasher(case["block_size"], fn),
    )
    if case["output_token_ids"]:
        req.append_output_token_ids(list(case["output_token_ids"]))
    return [bytes(h).hex() for h in req.block_hashes]


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != SEED:
        # the root seed must be the same in every process that checks the vectors
        os.environ["PYTHONHASHSEED"] = SEED
        os.execv(sys.executable, [sys.executable, *sys.argv])
    import vllm

    data = {"vllm": vllm.__version__, "PYTHONHASHSEED": SEED, "cases": []}
    for case in cases():
        case["block_hashes"] = {algo: vllm_hashes(case, algo) for algo in ALGOS}
        data["cases"].append(case)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT} ({len(data['cases'])} cases x {len(ALGOS)} algorithms, vLLM {vllm.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
