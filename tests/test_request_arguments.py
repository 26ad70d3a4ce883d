"""``kvblock.Request``'s constructor names the argument it refuses (new-user findings L3, L12).

Each case used to construct a request (or fail later with an error naming nothing): a
``lora_request`` that is a string (an ``AttributeError`` at hashing), a ``cache_salt`` that is
not a str (a ``ValueError``, where a wrong type is a ``TypeError``), a multimodal placeholder
running past the prompt, a 1-D ``prompt_embeds``, a NaN ``priority`` or ``arrival_time``, a
negative ``max_tokens``. kvblock's ``Request`` is kvblock's own (the vLLM drop-in takes vLLM's
``Request``), and what vLLM's API refuses is refused here too (``SamplingParams`` refuses
``max_tokens < 1``; vLLM's processor places placeholders inside the prompt; its
``prompt_embeds`` are ``[num_tokens, hidden]``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvblock import KVCacheManager, LoRARequest, Request, SamplingParams

TOKENS = list(range(64))


@pytest.mark.parametrize(
    "kw, exc, msg",
    [
        ({"lora_request": "adapter"}, TypeError, r"^lora_request: expected a LoRARequest .*got str"),
        ({"cache_salt": 123}, TypeError, r"^cache_salt: must be a str or None, got int"),
        ({"mm_features": [("img", 60, 20)]}, ValueError, r"^mm_features\[0\]: .*offset 60, length 20 runs past .* 64"),
        ({"priority": math.nan}, ValueError, r"^priority: must not be NaN"),
        ({"priority": "high"}, TypeError, r"^priority: must be a number, got str"),
        ({"arrival_time": math.nan}, ValueError, r"^arrival_time: must be finite, got nan"),
        ({"arrival_time": math.inf}, ValueError, r"^arrival_time: must be finite"),
        ({"arrival_time": "now"}, TypeError, r"^arrival_time: must be a number of seconds or None"),
        ({"max_tokens": -1}, ValueError, r"^max_tokens: must be >= 0, got -1"),
        ({"max_tokens": 1.5}, TypeError, r"^max_tokens: must be an int or None, got float"),
        ({"sampling_params": SamplingParams(max_tokens=-3)}, ValueError, r"^sampling_params.max_tokens: must be >= 0"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_a_bad_argument_is_named(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        Request("a", TOKENS, **kw)


def test_one_dimensional_prompt_embeds_are_refused():
    with pytest.raises(ValueError, match=r"^prompt_embeds: expected a \[num_tokens, hidden\] 2-D .* got 1-D"):
        Request("a", None, prompt_embeds=np.zeros(32, dtype=np.float32))


def test_what_vllm_accepts_still_constructs():
    """The edges that stay valid: a placeholder ending exactly at the prompt's end, priority
    as an int or a finite float, arrival_time None or finite, max_tokens 0 or None, a
    LoRARequest, a 2-D ``prompt_embeds``."""
    m = KVCacheManager(64, 16)
    r = Request(
        "a", TOKENS, mm_features=[("img", 44, 20)], priority=-2, arrival_time=1.5, max_tokens=0,
        lora_request=LoRARequest("ad", 1), block_hasher=m.request_block_hasher,
    )
    assert len(r.block_hashes) == 4 and r.max_tokens == 0
    assert Request("b", TOKENS, priority=0.5, arrival_time=None).priority == 0.5
    e = Request("c", None, prompt_embeds=np.zeros((32, 8), dtype=np.float32), block_hasher=m.request_block_hasher)
    assert e.num_tokens == 32 and len(e.block_hashes) == 2
