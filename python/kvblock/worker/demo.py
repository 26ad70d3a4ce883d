"""A paged-attention serving loop that shows prefix caching never changes model outputs.

A tiny decoder-only transformer (seeded random fp32 weights, RMSNorm, rotary positions,
grouped-query attention, SiLU-gated MLP) serves multi-turn conversations that share a
system prompt. Its KV cache is paged like vLLM's: one ``[num_blocks, block_size,
num_kv_heads, head_dim]`` key and value tensor per layer. Every step:

1. a continuous-batching scheduler shaped like vLLM v1's (running requests first, then
   waiting ones; a token budget with chunked prefill; recompute preemption when blocks run
   out) asks :class:`kvblock.manager.KVCacheManager` for blocks (``get_computed_blocks``,
   ``allocate_slots``, ``free``);
2. the worker mirrors them into a :class:`kvblock.worker.block_table.BlockTable` (``add_row`` /
   ``append_row``, ``swap_row`` to put decodes first, ``move_row`` to condense finished
   rows), commits it and computes the slot mapping;
3. each layer writes the step's K/V through the slot mapping, then attention reads every
   request's K/V through its block-table row (prefix-cache hits are read, never recomputed);
4. the last token of every request that reached the end of its known tokens is sampled
   greedily and appended with ``Request.append_output_token_ids`` (which hashes the blocks it
   completes).

:func:`run_demo` serves the same workload with prefix caching on and off and checks that the
greedy tokens are identical, the sampled logits agree to ``1e-4``, and the prefill tokens
actually computed fall by exactly the hit count the manager reports. ``python -m
kvblock.worker.demo`` (or :func:`main`) prints the comparison as a table.

Needs torch (the ``torch`` extra). Runs on CPU or CUDA.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without the torch extra
    from .._optional import install_hint

    raise ImportError(f"kvblock demo (kvblock.worker.demo) needs torch: {install_hint('torch', 'torch')}") from e

from .block_table import BlockTable, reshape_and_cache
from .demo_args import DemoConfig, ModelConfig, build_parser
from ..manager import KVCacheManager
from ..request import Request, RequestStatus, SamplingParams
from ..stats import PrefixCacheStats

__all__ = [
    "DemoConfig",
    "DemoReport",
    "ModelConfig",
    "ServeResult",
    "TinyDecoder",
    "Workload",
    "compare_results",
    "main",
    "make_workload",
    "run_demo",
    "serve",
]

#: Logits of the same token must agree to this (max absolute difference) between runs.
LOGITS_ATOL = 1e-4


# -- the model ------------------------------------------------------------------------------------
@dataclass
class AttentionMetadata:
    """What one forward step's attention needs (device tensors unless noted).

    Attributes:
        query_start_loc: int32 ``[num_reqs + 1]``: request ``r`` owns step tokens
            ``[query_start_loc[r], query_start_loc[r + 1])``.
        query_start_loc_host: the same offsets as a list (host).
        seq_lens: ``num_computed_tokens + num_scheduled`` per request (host list): the K/V
            positions ``0..seq_len-1`` attention reads.
        slot_mapping: int64 ``[>= num_tokens]``: where each step token's K/V is written.
        block_table: int32 ``[num_reqs, width]``: blocks of ``block_size`` tokens per row.
        block_size: tokens per block of ``block_table`` (the kernel block size).
    """

    query_start_loc: torch.Tensor
    query_start_loc_host: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    block_size: int


class TinyDecoder:
    """A 2-layer (by default) decoder-only transformer with seeded random fp32 weights.

    Weights are drawn on the CPU from ``torch.Generator().manual_seed(cfg.seed)`` and moved
    to ``device``, so every device gets the same model. :meth:`forward_paged` runs a step of
    scheduled tokens against a paged KV cache; :meth:`forward_dense` runs one whole sequence
    with ordinary causal attention (no cache), the reference the paged path is tested
    against.
    """

    def __init__(self, cfg: ModelConfig, device: Any = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(cfg.seed)
        H, Hkv, D, E, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, dtype=torch.float32) / math.sqrt(fan_in)).to(self.device)

        self.embed = w(cfg.vocab_size, E, fan_in=1)
        self.layers = []
        for _ in range(cfg.num_layers):
            self.layers.append(
                {
                    "norm1": (1.0 + 0.1 * torch.randn(E, generator=g)).to(self.device),
                    "wq": w(E, H * D, fan_in=E),
                    "wk": w(E, Hkv * D, fan_in=E),
                    "wv": w(E, Hkv * D, fan_in=E),
                    "wo": w(H * D, E, fan_in=H * D),
                    "norm2": (1.0 + 0.1 * torch.randn(E, generator=g)).to(self.device),
                    "w_gate": w(E, F, fan_in=E),
                    "w_up": w(E, F, fan_in=E),
                    "w_down": w(F, E, fan_in=F),
                }
            )
        self.final_norm = (1.0 + 0.1 * torch.randn(E, generator=g)).to(self.device)
        self.lm_head = w(E, cfg.vocab_size, fan_in=E)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        self._inv_freq = inv_freq.to(self.device)

    # -- building blocks ---------------------------------------------------------------------------
    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` ``[T, heads, D]`` at int64 ``positions`` ``[T]``."""
        ang = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = ang.cos().to(x.dtype)[:, None, :]
        sin = ang.sin().to(x.dtype)[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    def _qkv(self, layer: dict, h: torch.Tensor, positions: torch.Tensor):
        cfg = self.cfg
        x = self._rms_norm(h, layer["norm1"])
        q = (x @ layer["wq"]).view(-1, cfg.num_heads, cfg.head_dim)
        k = (x @ layer["wk"]).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = (x @ layer["wv"]).view(-1, cfg.num_kv_heads, cfg.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Causal attention of queries ``[n, H, D]`` at positions ``q_pos`` over keys/values
        ``[L, Hkv, D]`` at positions ``0..L-1``; returns ``[n, H * D]``."""
        cfg = self.cfg
        rep = cfg.num_heads // cfg.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) / math.sqrt(cfg.head_dim)
        key_pos = torch.arange(k.shape[0], device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hnl,lhd->nhd", probs, v).reshape(q.shape[0], -1)

    def _mlp(self, layer: dict, h: torch.Tensor) -> torch.Tensor:
        x = self._rms_norm(h, layer["norm2"])
        return (torch.nn.functional.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]

    def new_kv_caches(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One zeroed ``(key, value)`` pair of ``[num_blocks, block_size, num_kv_heads,
        head_dim]`` fp32 tensors per layer."""
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        return [
            (torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
            for _ in range(self.cfg.num_layers)
        ]

    # -- forward passes ----------------------------------------------------------------------------
    def forward_paged(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """One step over the scheduled tokens of a batch.

        In every layer the step's K/V are first written at ``meta.slot_mapping`` (all
        requests of the step, so a request may read blocks another request fills in the same
        step, as with vLLM), then each request's queries attend to K/V positions
        ``0..seq_len-1`` gathered through its block-table row: position ``j`` is slot
        ``block_table[r, j // bs] * bs + j % bs`` of the cache viewed in blocks of
        ``bs = meta.block_size`` tokens.

        Args:
            input_ids: int64 ``[num_tokens]``; positions: int64 ``[num_tokens]``.
            meta: the step's :class:`AttentionMetadata`.
            kv_caches: from :meth:`new_kv_caches`.

        Returns:
            hidden states, fp32 ``[num_tokens, hidden_size]``.
        """
        cfg = self.cfg
        n = input_ids.shape[0]
        slots = meta.slot_mapping[:n]
        qsl = meta.query_start_loc_host
        bs = meta.block_size
        read_idx = []
        for r, seq_len in enumerate(meta.seq_lens):
            if qsl[r + 1] == qsl[r]:
                read_idx.append(None)
                continue
            j = torch.arange(seq_len, device=self.device)
            row = meta.block_table[r]
            read_idx.append(row[j // bs].to(torch.int64) * bs + j % bs)
        h = self.embed[input_ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            q, k, v = self._qkv(layer, h, positions)
            reshape_and_cache(k, v, k_cache, v_cache, slots)
            k_flat = k_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)
            v_flat = v_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)
            attn = torch.empty(n, cfg.num_heads * cfg.head_dim, device=self.device)
            for r, idx in enumerate(read_idx):
                if idx is None:
                    continue
                a, b = qsl[r], qsl[r + 1]
                attn[a:b] = self._attend(q[a:b], k_flat[idx], v_flat[idx], positions[a:b])
            h = h + attn @ layer["wo"]
            h = h + self._mlp(layer, h)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits fp32 ``[n, vocab_size]`` of hidden states ``[n, hidden_size]``."""
        return self._rms_norm(hidden, self.final_norm) @ self.lm_head

    def forward_dense(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits fp32 ``[len(token_ids), vocab_size]`` of one whole sequence with ordinary
        causal attention and no KV cache: the reference for :meth:`forward_paged`."""
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        pos = torch.arange(ids.shape[0], device=self.device)
        h = self.embed[ids]
        for layer in self.layers:
            q, k, v = self._qkv(layer, h, pos)
            h = h + self._attend(q, k, v, pos) @ layer["wo"]
            h = h + self._mlp(layer, h)
        return self.compute_logits(h)


# -- the workload ---------------------------------------------------------------------------------
@dataclass
class Workload:
    """Conversations sharing one system prompt.

    Turn 0 of conversation ``c`` is ``system_prompt + questions[c][0]``; turn ``t > 0`` is
    the whole previous turn (its prompt and its generated tokens) plus ``questions[c][t]``,
    submitted when turn ``t - 1`` finishes. Every turn generates ``max_tokens`` tokens.
    """

    system_prompt: list[int]
    questions: list[list[list[int]]]
    max_tokens: int

    @property
    def num_turns(self) -> int:
        return sum(len(q) for q in self.questions)


def make_workload(
    num_conversations: int = 6,
    num_turns: int = 3,
    system_len: int = 48,
    question_len: tuple[int, int] = (6, 20),
    max_tokens: int = 12,
    vocab_size: int = 256,
    seed: int = 0,
) -> Workload:
    """A seeded :class:`Workload`. The last conversation repeats the first conversation's
    first question, so its first turn is an exact duplicate prompt (the manager then hits
    everything but the last block, which it always recomputes).

    Raises:
        ValueError: a non-positive count or length.
    """
    if min(num_conversations, num_turns, system_len, question_len[0], max_tokens) <= 0:
        raise ValueError("make_workload: counts and lengths must be positive")
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, system_len).tolist()
    questions = [
        [rng.integers(0, vocab_size, int(rng.integers(question_len[0], question_len[1] + 1))).tolist() for _ in range(num_turns)]
        for _ in range(num_conversations)
    ]
    if num_conversations > 1:
        questions[-1][0] = list(questions[0][0])
    return Workload(system, questions, max_tokens)


# -- serving ----------------------------------------------------------------------------------------
@dataclass
class ServeResult:
    """What :func:`serve` produced and measured.

    Attributes:
        enable_caching: prefix caching on or off.
        outputs: generated token ids per request id (``"c{conv}-t{turn}"``).
        logits: the logits each generated token was sampled from, fp32 ``[max_tokens,
            vocab_size]`` per request (CPU).
        prompts: each request's prompt token ids.
        admitted_tokens: tokens of every admission summed (``num_tokens`` at admission,
            re-admissions after preemption included).
        hit_tokens: prefix-cache hit tokens over every admission (as ``get_computed_blocks``
            returned them).
        prefill_tokens_computed: tokens fed to the model at positions below the request's
            ``num_tokens`` at admission.
        abandoned_prefill_tokens: prefill tokens of an admission that a preemption cut
            short (admitted but never computed; that admission's hits are still counted).
        decode_tokens_computed: the other tokens fed to the model.
        stats: the manager's :class:`~kvblock.stats.PrefixCacheStats` (``log_stats`` on).
        num_preemptions, steps, seconds: counters and wall time.
        max_dense_logits_diff: with ``verify_dense``, the largest difference between the
            sampled logits and a cache-free dense forward pass of the same sequence.
    """

    enable_caching: bool
    outputs: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    admitted_tokens: int = 0
    hit_tokens: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    abandoned_prefill_tokens: int = 0
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0
    steps: int = 0
    seconds: float = 0.0
    max_dense_logits_diff: float | None = None

    @property
    def reported_hits(self) -> int:
        """Hit tokens the manager's stats report (``hits + preempted_hits``)."""
        return self.stats.hits + self.stats.preempted_hits


@dataclass
class _Seq:
    """A request in the engine."""

    req: Request
    conv: int
    turn: int
    logits: list[torch.Tensor] = field(default_factory=list)
    admitted_tokens: int = 0


def serve(
    model: TinyDecoder,
    workload: Workload,
    *,
    enable_caching: bool,
    block_size: int = 16,
    num_blocks: int = 256,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    kernel_block_size: int | None = None,
    verify_tables: bool = True,
    verify_dense: bool = False,
) -> ServeResult:
    """Serve ``workload`` on ``model`` with a vLLM-v1-shaped continuous-batching loop.

    Each step schedules running requests first (in row order; a request whose blocks
    cannot be allocated preempts the last running request, vLLM's recompute preemption),
    then admits waiting requests (``get_computed_blocks`` + ``allocate_slots`` with the
    hit, ``record_prefix_cache_stats``) while fewer than ``max_num_seqs`` run and the
    ``max_num_batched_tokens`` budget lasts (long prompts are prefilled in chunks).

    Args:
        model: the :class:`TinyDecoder` (its device is used).
        workload: from :func:`make_workload`.
        enable_caching: prefix caching on/off in the manager.
        block_size: manager block size (tokens); num_blocks: KV cache blocks (block 0 is the
            null block).
        max_num_seqs, max_num_batched_tokens: scheduler limits (rows, tokens per step).
        kernel_block_size: read the cache through the kernel block table in blocks of this
            many tokens (must divide ``block_size``; default ``block_size``).
        verify_tables: after every step's scheduling, check each block-table row equals the
            manager's block ids for its request.
        verify_dense: compare every sampled logits row with :meth:`TinyDecoder.forward_dense`
            of the same sequence (slow for long workloads).

    Returns:
        A :class:`ServeResult`.

    Raises:
        RuntimeError: the pool cannot hold a single request; a block-table row disagrees
            with the manager (``verify_tables``).
    """
    cfg = model.cfg
    dev = model.device
    max_len = max(
        len(workload.system_prompt) + sum(len(q) for q in conv) + len(conv) * workload.max_tokens
        for conv in workload.questions
    )
    mgr = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, log_stats=True, max_model_len=max_len)
    hasher = mgr.request_block_hasher if enable_caching else None
    max_blocks = -(-max_len // block_size)
    bt = BlockTable(
        block_size, max_num_seqs, max_blocks, max_num_batched_tokens, dev, pin_memory=True,
        kernel_block_size=kernel_block_size,
    )
    read_block_size = bt.kernel_block_size
    kv_caches = model.new_kv_caches(num_blocks, block_size)
    sampling = SamplingParams(max_tokens=workload.max_tokens)
    result = ServeResult(enable_caching=enable_caching)

    def new_request(conv: int, turn: int, prev: Request | None) -> _Seq:
        base = workload.system_prompt if prev is None else prev.all_token_ids
        prompt = list(base) + list(workload.questions[conv][turn])
        rid = f"c{conv}-t{turn}"
        result.prompts[rid] = prompt
        return _Seq(Request(rid, prompt, sampling, block_hasher=hasher), conv, turn)

    waiting: deque[_Seq] = deque(new_request(c, 0, None) for c in range(len(workload.questions)))
    running: list[_Seq] = []
    t_start = time.perf_counter()

    def preempt(seq: _Seq) -> None:
        # vLLM's recompute preemption: free every block, restart from token 0.
        row = running.index(seq)
        assert row == len(running) - 1
        running.pop()
        bt.clear_row(row)
        mgr.free(seq.req)
        result.abandoned_prefill_tokens += max(0, seq.admitted_tokens - seq.req.num_computed_tokens)
        seq.req.status = RequestStatus.PREEMPTED
        seq.req.num_computed_tokens = 0
        seq.req.num_preemptions += 1
        result.num_preemptions += 1
        waiting.appendleft(seq)

    while waiting or running:
        result.steps += 1
        budget = max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted = False

        # (1) Running requests, in row order.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            req = seq.req
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new = mgr.allocate_slots(req, n)
            while new is None:
                victim = running[-1]
                preempt(victim)
                preempted = True
                if victim is seq:
                    break
                new = mgr.allocate_slots(req, n)
            if new is None:
                break
            bt.append_row(new.get_block_ids()[0], i)
            scheduled[req.request_id] = n
            budget -= n
            i += 1

        # (2) Waiting requests (none after a preemption in this step, as in vLLM).
        while waiting and not preempted and len(running) < max_num_seqs and budget > 0:
            seq = waiting[0]
            req = seq.req
            hit_blocks, n_hit, _ = mgr.get_computed_blocks(req)
            n = min(req.num_tokens - n_hit, budget)
            new = mgr.allocate_slots(req, n, n_hit, hit_blocks)
            if new is None:
                if not running and not scheduled:
                    raise RuntimeError(f"num_blocks={num_blocks} cannot hold request {req.request_id}")
                break
            waiting.popleft()
            mgr.record_prefix_cache_stats(req, n_hit)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = n_hit
            seq.admitted_tokens = req.num_tokens
            result.admitted_tokens += req.num_tokens
            result.hit_tokens += n_hit
            bt.add_row(hit_blocks.get_block_ids()[0] + new.get_block_ids()[0], len(running))
            running.append(seq)
            scheduled[req.request_id] = n
            budget -= n

        if not scheduled:
            raise RuntimeError(f"no request could be scheduled (num_blocks={num_blocks} cannot hold the next request)")

        # (3) Decodes first (vLLM reorders the persistent batch with swaps).
        def is_decode(s: _Seq) -> bool:
            return scheduled.get(s.req.request_id, 0) == 1

        lo, hi = 0, len(running) - 1
        while True:
            while lo < hi and is_decode(running[lo]):
                lo += 1
            while lo < hi and not is_decode(running[hi]):
                hi -= 1
            if lo >= hi:
                break
            running[lo], running[hi] = running[hi], running[lo]
            bt.swap_row(lo, hi)

        if verify_tables:
            for r, seq in enumerate(running):
                want = mgr.get_block_ids(seq.req.request_id)[0]
                if bt.row(r) != want:
                    raise RuntimeError(f"row {r} ({seq.req.request_id}): table {bt.row(r)} != manager {want}")

        # (4) The model step.
        ids: list[int] = []
        pos: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for r, seq in enumerate(running):
            req = seq.req
            n = scheduled.get(req.request_id, 0)
            c = req.num_computed_tokens
            ids.extend(req.all_token_ids[c : c + n])
            pos.extend(range(c, c + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            if n and c + n == req.num_tokens:
                sample_rows.append(r)
            prefill = max(0, min(c + n, seq.admitted_tokens) - c)
            result.prefill_tokens_computed += prefill
            result.decode_tokens_computed += n - prefill
        num_reqs = len(running)
        bt.commit_block_table(num_reqs)
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        slot_mapping = bt.compute_slot_mapping(qsl_t, pos_t)
        meta = AttentionMetadata(
            qsl_t, qsl, seq_lens, slot_mapping, bt.kernel_block_table(num_reqs), read_block_size
        )
        hidden = model.forward_paged(torch.tensor(ids, dtype=torch.int64, device=dev), pos_t, meta, kv_caches)
        sample_idx = torch.tensor([qsl[r + 1] - 1 for r in sample_rows], dtype=torch.int64, device=dev)
        logits = model.compute_logits(hidden[sample_idx]).cpu()
        tokens = logits.argmax(dim=-1).tolist()

        # (5) Update the requests; finish, free and condense.
        for seq in running:
            seq.req.num_computed_tokens += scheduled.get(seq.req.request_id, 0)
        finished: list[int] = []
        for k, r in enumerate(sample_rows):
            seq = running[r]
            seq.logits.append(logits[k])
            seq.req.append_output_token_ids(tokens[k])
            if seq.req.num_output_tokens >= workload.max_tokens:
                finished.append(r)
        for r in sorted(finished, reverse=True):
            seq = running[r]
            req = seq.req
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            mgr.free(req)
            rid = req.request_id
            result.outputs[rid] = list(req.output_token_ids)
            result.logits[rid] = torch.stack(seq.logits)
            last = len(running) - 1
            if r != last:
                bt.move_row(last, r)
                running[r] = running[last]
            else:
                bt.clear_row(r)
            running.pop()
            if seq.turn + 1 < len(workload.questions[seq.conv]):
                waiting.append(new_request(seq.conv, seq.turn + 1, req))

    result.seconds = time.perf_counter() - t_start
    result.stats = mgr.make_prefix_cache_stats()
    if verify_dense:
        worst = 0.0
        for rid, out in result.outputs.items():
            seq_ids = result.prompts[rid] + out
            dense = model.forward_dense(seq_ids[:-1]).cpu()
            start = len(result.prompts[rid]) - 1
            worst = max(worst, float((dense[start:] - result.logits[rid]).abs().max()))
        result.max_dense_logits_diff = worst
    return result


# -- the comparison -------------------------------------------------------------------------------
@dataclass
class DemoReport:
    """Caching on vs off on one device.

    Attributes:
        device: where it ran.
        on, off: the two :class:`ServeResult` objects.
        tokens_identical: every request generated the same tokens in both runs.
        max_logits_diff: largest absolute difference between the sampled logits of the runs.
        prefill_saved: ``off.prefill_tokens_computed - on.prefill_tokens_computed``.
        ok: tokens identical, logits within :data:`LOGITS_ATOL`, each run's prefill tokens
            computed equal its admitted tokens minus its reported hits (minus prefill cut
            short by preemption), and, when neither run preempted (the two runs then admit
            the same tokens), ``prefill_saved == on.reported_hits``: the prefill work fell by
            exactly the hit count the manager reports.
        failures: what failed, in words.
    """

    device: str
    on: ServeResult
    off: ServeResult
    tokens_identical: bool
    max_logits_diff: float
    prefill_saved: int
    ok: bool
    failures: list[str]


def compare_results(on: ServeResult, off: ServeResult, device: str = "cpu", atol: float = LOGITS_ATOL) -> DemoReport:
    """Check that caching changed nothing but the work done (see :class:`DemoReport`)."""
    failures: list[str] = []
    tokens_identical = on.outputs == off.outputs
    if not tokens_identical:
        diff = sorted(k for k in set(on.outputs) | set(off.outputs) if on.outputs.get(k) != off.outputs.get(k))
        failures.append(f"greedy tokens differ for {diff[:5]}")
    max_diff = 0.0
    for rid, lo in on.logits.items():
        lf = off.logits.get(rid)
        if lf is None or lf.shape != lo.shape:
            failures.append(f"logits of {rid} missing or of another shape")
            max_diff = math.inf
            continue
        max_diff = max(max_diff, float((lo - lf).abs().max()))
    if not max_diff <= atol:
        failures.append(f"logits differ by {max_diff:.3g} > {atol:g}")
    saved = off.prefill_tokens_computed - on.prefill_tokens_computed
    for res in (on, off):
        expect = res.admitted_tokens - res.reported_hits - res.abandoned_prefill_tokens
        if res.prefill_tokens_computed != expect:
            failures.append(
                f"caching {'on' if res.enable_caching else 'off'}: prefill computed "
                f"{res.prefill_tokens_computed} != admitted {res.admitted_tokens} - reported hits "
                f"{res.reported_hits} - abandoned {res.abandoned_prefill_tokens}"
            )
        if res.reported_hits != res.hit_tokens:
            failures.append(f"reported hits {res.reported_hits} != hits returned {res.hit_tokens}")
    if off.reported_hits != 0:
        failures.append(f"caching off reported {off.reported_hits} hits")
    if on.num_preemptions == 0 and off.num_preemptions == 0 and saved != on.reported_hits:
        failures.append(f"prefill fell by {saved}, but {on.reported_hits} hit tokens were reported")
    return DemoReport(device, on, off, tokens_identical, max_diff, saved, not failures, failures)


def run_demo(device: Any = "cpu", config: DemoConfig | None = None) -> DemoReport:
    """Serve the same workload with prefix caching on and off on ``device`` and compare.

    Raises:
        RuntimeError: as :func:`serve`.
    """
    config = config or DemoConfig()
    model = TinyDecoder(config.model, device)
    workload = make_workload(
        config.num_conversations, config.num_turns, config.system_len, config.question_len,
        config.max_tokens, config.model.vocab_size, config.workload_seed,
    )
    kwargs = dict(
        block_size=config.block_size, num_blocks=config.num_blocks, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, kernel_block_size=config.kernel_block_size,
        verify_dense=config.verify_dense,
    )
    on = serve(model, workload, enable_caching=True, **kwargs)
    off = serve(model, workload, enable_caching=False, **kwargs)
    return compare_results(on, off, str(model.device))


# -- command line ---------------------------------------------------------------------------------
def report_rows(report: DemoReport) -> list[tuple[str, str, str]]:
    """``(metric, caching on, caching off)`` rows of the report table."""
    on, off = report.on, report.off
    rows = [
        ("requests", str(len(on.outputs)), str(len(off.outputs))),
        ("steps", str(on.steps), str(off.steps)),
        ("admitted prompt tokens", str(on.admitted_tokens), str(off.admitted_tokens)),
        ("reported hit tokens", str(on.reported_hits), str(off.reported_hits)),
        ("prefill tokens computed", str(on.prefill_tokens_computed), str(off.prefill_tokens_computed)),
        ("decode tokens computed", str(on.decode_tokens_computed), str(off.decode_tokens_computed)),
        ("preemptions", str(on.num_preemptions), str(off.num_preemptions)),
        ("prefill cut short by preemption", str(on.abandoned_prefill_tokens), str(off.abandoned_prefill_tokens)),
        ("wall time (s)", f"{on.seconds:.3f}", f"{off.seconds:.3f}"),
    ]
    if on.max_dense_logits_diff is not None:
        rows.append(("max |logits - dense|", f"{on.max_dense_logits_diff:.2e}", f"{off.max_dense_logits_diff:.2e}"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``kvblock demo``: run :func:`run_demo` and print a table (or JSON). Returns 0 if the
    outputs match (tokens identical, logits within 1e-4, prefill saved == reported hits),
    1 otherwise."""
    args = build_parser().parse_args(argv)
    model_cfg = ModelConfig(seed=args.seed)
    config = DemoConfig(
        model=model_cfg,
        num_conversations=args.conversations,
        num_turns=args.turns,
        system_len=args.system_len,
        max_tokens=args.max_tokens,
        workload_seed=args.seed,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kernel_block_size=args.kernel_block_size,
        verify_dense=args.verify_dense,
    )
    report = run_demo(args.device, config)
    if args.json:
        print(
            json.dumps(
                {
                    "device": report.device,
                    "ok": report.ok,
                    "failures": report.failures,
                    "tokens_identical": report.tokens_identical,
                    "max_logits_diff": report.max_logits_diff,
                    "prefill_saved": report.prefill_saved,
                    "rows": report_rows(report),
                    "config": asdict(config),
                },
                indent=2,
            )
        )
        return 0 if report.ok else 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvblock demo on {report.device}: prefix caching on vs off")
    table.add_column("metric")
    table.add_column("caching on", justify="right")
    table.add_column("caching off", justify="right")
    for row in report_rows(report):
        table.add_row(*row)
    console = Console()
    console.print(table)
    verdict = "[green]PASS[/green]" if report.ok else "[red]FAIL[/red]"
    console.print(
        f"{verdict}: greedy tokens identical: {report.tokens_identical}; max |Δlogits| = "
        f"{report.max_logits_diff:.2e} (limit {LOGITS_ATOL:g}); prefill tokens saved = "
        f"{report.prefill_saved}, reported hits = {report.on.reported_hits}"
    )
    for f in report.failures:
        console.print(f"[red]- {f}[/red]")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
