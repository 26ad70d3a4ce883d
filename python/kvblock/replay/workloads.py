"""Built-in workloads, generated in code so ``kvblock replay`` runs with no file.

* ``shared-prompt``: the seeded ``apc-peer-v1`` workload of :mod:`kvblock.replay.peer_workload` (1000
  requests of 2048 tokens, three in four starting with one 1536-token system prompt, 128
  outputs each), with the manager and scheduler settings of its README §2–3: 16384 blocks of
  16 tokens, at most 64 running, no token budget, no chunked prefill, all requests waiting
  from the start. vLLM 0.33.0 hits 1,150,464 of 2,048,000 tokens on it.
* ``chat``: seeded multi-turn conversations. Each conversation starts with one of a few
  shared system prompts; turn ``t``'s prompt is the previous turn's prompt, the previous
  answer and a new user message, and its outputs are the answer that the next turn repeats,
  so answers cached during decode are hit by the following turn, as in a chat service.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import peer_workload as apc
from .errors import ReplayError
from .trace import SchedulerDefaults, Trace, TraceRequest

__all__ = ["WORKLOADS", "ChatParams", "builtin_workload", "chat_workload", "shared_prompt_workload"]


def shared_prompt_workload(num_requests: int = apc.NUM_REQUESTS) -> Trace:
    """The ``apc-peer-v1`` workload (token ids from :func:`kvblock.replay.peer_workload.e2e_request_tokens`).

    Args:
        num_requests: the first ``num_requests`` of its 1000 requests.
    """
    if not 1 <= num_requests <= apc.NUM_REQUESTS:
        raise ReplayError(f"the shared-prompt workload has 1 to {apc.NUM_REQUESTS} requests, got {num_requests}")
    system = apc.token_array(0, 0, apc.SHARED_PREFIX_LEN)
    requests = []
    for i in range(num_requests):
        if i % 4 != 3:
            prompt = np.concatenate([system, apc.token_array(1 + i, apc.SHARED_PREFIX_LEN, apc.PROMPT_LEN)])
        else:
            prompt = apc.token_array(1 + i, 0, apc.PROMPT_LEN)
        outputs = apc.token_array(1 + i, apc.PROMPT_LEN, apc.PROMPT_LEN + apc.DECODE_TOKENS)
        requests.append(TraceRequest(
            index=i, request_id=f"req-{i}", arrival_ms=0.0, prompt_len=apc.PROMPT_LEN,
            output_len=apc.DECODE_TOKENS, prompt_tokens=prompt, output_tokens=outputs,
        ))
    return Trace(
        name="shared-prompt",
        source="builtin:shared-prompt",
        requests=requests,
        format="builtin",
        defaults=SchedulerDefaults(
            num_blocks=apc.NUM_BLOCKS, block_size=apc.BLOCK_SIZE, max_running=apc.MAX_RUNNING,
            token_budget=0, chunked_prefill=False, hash_algo=apc.HASH_ALGO, asap=True,
        ),
        description=(
            f"{apc.NAME}: {num_requests} x {apc.PROMPT_LEN}-token prompts, 3 in 4 share a "
            f"{apc.SHARED_PREFIX_LEN}-token system prompt, {apc.DECODE_TOKENS} outputs each"
        ),
    )


@dataclass(frozen=True)
class ChatParams:
    """Parameters of the ``chat`` workload (lengths in tokens, times in seconds).

    Turn counts are ``1 + Geometric(1 / mean_extra_turns)`` capped at ``max_turns``; user
    message and answer lengths are uniform in their ranges; conversations start as a Poisson
    process; the next turn arrives an estimated decode time (``decode_s_per_token`` per
    answer token) plus an exponential think time after the previous one.
    """

    seed: int = 20250229
    conversations: int = 300
    system_prompts: int = 4
    system_prompt_len: int = 1024
    max_turns: int = 8
    mean_extra_turns: float = 2.5
    user_len: tuple[int, int] = (32, 512)
    answer_len: tuple[int, int] = (64, 512)
    conversations_per_s: float = 1.0
    think_s: float = 30.0
    decode_s_per_token: float = 0.02


def chat_workload(params: ChatParams = ChatParams()) -> Trace:
    """Generate the ``chat`` workload (deterministic for given parameters).

    Token ids are ``kvblock.replay.peer_workload`` splitmix64 streams under ``params.seed``: stream ``s``
    for system prompt ``s``, stream ``system_prompts + c`` for conversation ``c`` (its user
    messages and answers in order).

    Raises:
        ReplayError: non-positive counts or lengths, or empty ranges.
    """
    p = params
    if p.conversations < 1 or p.system_prompts < 1 or p.max_turns < 1 or p.system_prompt_len < 0:
        raise ReplayError("chat workload: counts must be >= 1 and lengths >= 0")
    for name, (lo, hi) in (("user_len", p.user_len), ("answer_len", p.answer_len)):
        if not 1 <= lo <= hi:
            raise ReplayError(f"chat workload: {name} must satisfy 1 <= low <= high, got {(lo, hi)}")
    rng = np.random.default_rng(p.seed)
    vocab = apc.VOCAB_SIZE
    systems = [apc.token_array(s, 0, p.system_prompt_len, seed=p.seed, vocab_size=vocab) for s in range(p.system_prompts)]
    starts = np.cumsum(rng.exponential(1.0 / p.conversations_per_s, size=p.conversations))
    turns = np.minimum(1 + rng.geometric(1.0 / (1.0 + p.mean_extra_turns), size=p.conversations) - 1, p.max_turns)
    records: list[tuple[float, int, int, np.ndarray, np.ndarray]] = []
    for c in range(p.conversations):
        stream = p.system_prompts + c
        context = systems[int(rng.integers(p.system_prompts))]
        t = float(starts[c])
        pos = 0
        for turn in range(int(turns[c])):
            u = int(rng.integers(p.user_len[0], p.user_len[1] + 1))
            a = int(rng.integers(p.answer_len[0], p.answer_len[1] + 1))
            user = apc.token_array(stream, pos, pos + u, seed=p.seed, vocab_size=vocab)
            answer = apc.token_array(stream, pos + u, pos + u + a, seed=p.seed, vocab_size=vocab)
            pos += u + a
            prompt = np.concatenate([context, user])
            records.append((t * 1e3, c, turn, prompt, answer))
            context = np.concatenate([prompt, answer])
            t += a * p.decode_s_per_token + float(rng.exponential(p.think_s))
    records.sort(key=lambda r: r[0])
    requests = [
        TraceRequest(
            index=i, request_id=f"chat-{c}-turn-{turn}", arrival_ms=ts, prompt_len=len(prompt),
            output_len=len(answer), prompt_tokens=prompt, output_tokens=answer, session=c,
        )
        for i, (ts, c, turn, prompt, answer) in enumerate(records)
    ]
    return Trace(
        name="chat",
        source="builtin:chat",
        requests=requests,
        format="builtin",
        defaults=SchedulerDefaults(num_blocks=8192, block_size=16),
        description=(
            f"multi-turn chat: {p.conversations} conversations, {len(requests)} turns, "
            f"{p.system_prompts} shared {p.system_prompt_len}-token system prompts"
        ),
    )


#: Built-in workloads by name (the first is the default of ``kvblock replay``).
WORKLOADS = {
    "shared-prompt": shared_prompt_workload,
    "chat": chat_workload,
}


def builtin_workload(name: str) -> Trace:
    """The built-in workload ``name``.

    Raises:
        ReplayError: an unknown name (the message lists the built-ins).
    """
    try:
        return WORKLOADS[name]()
    except KeyError:
        raise ReplayError(f"unknown workload {name!r}; built-ins: {', '.join(WORKLOADS)}") from None
