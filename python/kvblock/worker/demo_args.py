"""``kvblock demo``'s settings and command line, without torch: ``kvblock demo --help`` and
its usage errors work where torch is not installed (:mod:`kvblock.worker.demo` runs it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

__all__ = ["DemoConfig", "ModelConfig", "build_parser"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`kvblock.worker.demo.TinyDecoder` (fp32). ``num_heads`` must be a multiple of
    ``num_kv_heads`` (grouped-query attention) and ``head_dim`` even (rotary)."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads: must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim: must be even (rotary embedding)")


@dataclass
class DemoConfig:
    """Everything :func:`run_demo` needs besides the device."""

    model: ModelConfig = field(default_factory=ModelConfig)
    num_conversations: int = 6
    num_turns: int = 3
    system_len: int = 48
    question_len: tuple[int, int] = (6, 20)
    max_tokens: int = 12
    workload_seed: int = 0
    block_size: int = 16
    num_blocks: int = 256
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    kernel_block_size: int | None = None
    verify_dense: bool = False


def build_parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="kvblock demo",
        description="Serve multi-turn conversations on a tiny paged-attention model with prefix "
        "caching on and off; check the outputs are identical. Needs torch (pip install torch).",
    )
    p.add_argument("--device", default="cpu", help="torch device (default cpu; 'cuda' for a GPU)")
    p.add_argument("--conversations", type=int, default=d.num_conversations, metavar="N",
                   help=f"multi-turn conversations served (default {d.num_conversations})")
    p.add_argument("--turns", type=int, default=d.num_turns, metavar="N",
                   help=f"turns per conversation (default {d.num_turns})")
    p.add_argument("--system-len", type=int, default=d.system_len, metavar="TOKENS",
                   help=f"shared system prompt tokens (default {d.system_len})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help=f"generated tokens per turn (default {d.max_tokens})")
    p.add_argument("--block-size", type=int, default=d.block_size, metavar="N",
                   help=f"tokens per KV-cache block (default {d.block_size})")
    p.add_argument("--kernel-block-size", type=int, default=None, metavar="N",
                   help="read the cache in smaller kernel blocks (default: --block-size)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, metavar="N",
                   help=f"KV-cache blocks including the null block (default {d.num_blocks})")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
                   help=f"most requests running at once, vLLM max_num_seqs (default {d.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, metavar="N",
                   help=f"tokens per scheduler step, vLLM max_num_batched_tokens (default {d.max_num_batched_tokens})")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="model and workload seed (default 0)")
    p.add_argument("--verify-dense", action="store_true", help="also compare with a cache-free dense forward")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p
