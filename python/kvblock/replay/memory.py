"""Cache budgets in bytes: a model's KV cache bytes per token as vLLM sizes it.

vLLM turns the memory left for the KV cache into blocks as
``num_blocks = available_memory // bytes_per_block`` (``kv_cache_planning.py``), where a block's
bytes are the sum over the layers of its group of each layer spec's ``page_size_bytes``
(``kv_cache_interface.py``):

* full attention (``FullAttentionSpec``): ``block_size * num_kv_heads * (head_size +
  head_size_v) * dtype bytes`` per layer, so ``2 * layers * kv_heads * head_dim * bytes`` per
  token;
* MLA (``MLAAttentionSpec``, DeepSeek-V2/V3): one latent of ``kv_lora_rank +
  qk_rope_head_dim`` per token and layer, no separate V: ``layers * (kv_lora_rank +
  qk_rope_head_dim) * bytes``;
* sliding-window layers (``SlidingWindowSpec``): the same page as full attention. vLLM's
  hybrid allocator puts them in groups of their own whose blocks beyond the window are freed;
  kvblock's replay has one group, and counts them as full-attention layers, as vLLM does with
  ``--disable-hybrid-kv-cache-manager`` (``unify_hybrid_kv_cache_specs``). The bytes per token
  are the same either way; the hit rate is that of full attention over all layers;
* Mamba layers (``MambaSpec``): a state per request, not per token (conv state
  ``(conv_kernel - 1) x conv_dim`` plus the SSM state, in the model's dtype). kvblock does not
  model the caching of Mamba states: the bytes per token are the attention layers', and one
  request's state is taken out of the budget (the ideal replay runs one request at a time).

The catalog (:data:`CATALOG`) holds the few ``config.json`` fields each model needs;
:func:`load_sizing` also reads a local ``config.json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from .config import MAX_NUM_BLOCKS
from .errors import ReplayError

__all__ = ["CATALOG", "KV_DTYPES", "KVSizing", "check_budget", "format_bytes", "load_sizing", "parse_bytes",
           "sizing_from_config"]

#: The fields of each model's Hugging Face ``config.json`` that the sizing reads (values from
#: the models' published configs).
CATALOG: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": {"source": "meta-llama/Llama-3.1-8B", "model_type": "llama", "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                     "torch_dtype": "bfloat16"},
    "Llama-3.1-70B": {"source": "meta-llama/Llama-3.1-70B", "model_type": "llama", "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192,
                      "torch_dtype": "bfloat16"},
    "Qwen3-8B": {"source": "Qwen/Qwen3-8B", "model_type": "qwen3", "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
                 "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16"},
    "Qwen3-32B": {"source": "Qwen/Qwen3-32B", "model_type": "qwen3", "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120,
                  "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16"},
    "DeepSeek-V3": {"source": "deepseek-ai/DeepSeek-V3", "model_type": "deepseek_v3", "num_hidden_layers": 61,
                    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "torch_dtype": "bfloat16"},
    "Mistral-7B": {"source": "mistralai/Mistral-7B-v0.1", "model_type": "mistral", "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                   "sliding_window": 4096, "torch_dtype": "bfloat16"},
    "Jamba-v0.1": {"source": "ai21labs/Jamba-v0.1", "model_type": "jamba", "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                   "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4,
                   "mamba_expand": 2, "torch_dtype": "bfloat16"},
}

#: ``--kv-dtype`` values and their bytes per element (``auto``: the model's dtype, 2 bytes;
#: vLLM runs fp32 checkpoints in fp16 under ``--dtype auto``).
KV_DTYPES: dict[str, int] = {"auto": 2, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
                             "fp32": 4, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_BYTES_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(" + "|".join(_UNITS) + ")", re.I)
#: The byte units ``--capacities`` takes (any case), for messages.
BYTE_UNITS = "B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB"


def parse_bytes(text: str) -> int | None:
    """``8GiB`` / ``512MiB`` / ``1.5GB`` -> bytes; None when ``text`` is not a size in bytes."""
    m = _BYTES_RE.fullmatch(text.strip())
    if m is None:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000}


def parse_capacities(specs: Sequence[str], sizes_in_bytes: bool = True) -> list[int | None]:
    """Parse capacities in blocks: ints with an optional ``k`` / ``m`` suffix, separated by
    commas or given as several arguments; ``inf`` / ``unlimited`` means unlimited (None).

    Returns them sorted ascending, unlimited last, without duplicates. ``sizes_in_bytes``:
    whether the caller also takes sizes in bytes (``kvblock sweep --model``), which the error
    for an unparsable capacity then mentions.

    Raises:
        ReplayError: no capacity, an unparsable one, or one below 2 blocks (block 0 is the
            null block, so 2 is the smallest cache that holds anything).
    """
    out: set[int | None] = set()
    for spec in specs:
        for part in str(spec).split(","):
            s = part.strip().lower()
            if not s:
                continue
            if s in ("inf", "unlimited", "none"):
                out.add(None)
                continue
            m = re.fullmatch(r"(\d+(?:\.\d+)?)([km]?)", s)
            if m is None:
                raise ReplayError(f"bad capacity {part.strip()!r}: expected a block count such as 1000, 10k or inf"
                                  + (f", or with --model a size in bytes such as 8GiB (units: {BYTE_UNITS})"
                                     if sizes_in_bytes else ""))
            value = float(m.group(1)) * _SUFFIX[m.group(2)]
            if value != int(value):
                raise ReplayError(f"bad capacity {part.strip()!r}: not a whole number of blocks")
            if value < 2:
                raise ReplayError(
                    f"capacity {part.strip()} is too small: at least 2 blocks (block 0 is vLLM's null block)"
                )
            if value > MAX_NUM_BLOCKS:
                raise ReplayError(
                    f"capacity {part.strip()} is too large: at most {MAX_NUM_BLOCKS:,} blocks (int32 block ids)"
                )
            out.add(int(value))
    if not out:
        raise ReplayError("no capacities given (e.g. --capacities 1k,10k,100k,inf)")
    finite = sorted(c for c in out if c is not None)
    return finite + ([None] if None in out else [])


def format_bytes(n: float) -> str:
    """Bytes in binary units: ``8.00 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class KVSizing:
    """A model's KV cache per token, as vLLM sizes it.

    Attributes:
        model: the catalog name or config path; kind: ``full``, ``mla`` or ``hybrid-mamba``;
        kv_dtype: as given; dtype_bytes: bytes per element; bytes_per_token: of all
        attention layers; attention_layers; sliding_window_layers: among them (counted as
        full attention); sliding_window: their window; mamba_layers; mamba_state_bytes: one
        request's Mamba state (all Mamba layers); formula: how bytes_per_token was computed.
    """

    model: str
    kind: str
    kv_dtype: str
    dtype_bytes: int
    bytes_per_token: int
    attention_layers: int
    sliding_window_layers: int
    sliding_window: int | None
    mamba_layers: int
    mamba_state_bytes: int
    formula: str

    def bytes_per_block(self, block_size: int) -> int:
        """vLLM's ``bytes_per_block``: every attention layer's page of ``block_size`` tokens."""
        return self.bytes_per_token * block_size

    def blocks_for(self, budget: int, block_size: int) -> int:
        """``num_blocks`` (null block included) for a budget of ``budget`` bytes, as vLLM's
        ``available_memory // bytes_per_block``, less one request's Mamba state."""
        return max(0, budget - self.mamba_state_bytes) // self.bytes_per_block(block_size)

    def budget_of(self, num_blocks: int, block_size: int) -> int:
        """The bytes ``num_blocks`` blocks take (Mamba state included)."""
        return num_blocks * self.bytes_per_block(block_size) + self.mamba_state_bytes

    def describe(self, block_size: int) -> str:
        """One line: the model, its bytes per token and how, the block's bytes."""
        extra = ""
        if self.sliding_window_layers:
            extra += (f"; {self.sliding_window_layers} sliding-window layers (window {self.sliding_window}) "
                      "counted as full attention")
        if self.mamba_layers:
            extra += (f"; {self.mamba_layers} Mamba layers: {format_bytes(self.mamba_state_bytes)} of state per "
                      "request, taken once from each budget")
        return (f"{self.model}, {self.kv_dtype} KV cache: {self.bytes_per_token:,} bytes/token "
                f"({self.formula}), {format_bytes(self.bytes_per_block(block_size))} per {block_size}-token "
                f"block{extra}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _need(cfg: dict[str, Any], key: str, where: str, minimum: int = 1) -> int:
    value = cfg.get(key)
    if value is None:
        raise ReplayError(f"{where}: config.json has no {key!r} (needed to size the KV cache)")
    return _count(value, key, where, minimum)


def _count(value: Any, key: str, where: str, minimum: int = 1) -> int:
    """A config.json count: a JSON integer (not a bool, a float or a string) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReplayError(f"{where}: config.json field {key!r} is not an integer: {value!r}")
    if value < minimum:
        raise ReplayError(f"{where}: config.json field {key!r} must be >= {minimum}, got {value}")
    return value


def _dtype_bytes(kv_dtype: str) -> int:
    try:
        return KV_DTYPES[kv_dtype.lower()]
    except KeyError:
        raise ReplayError(f"unknown --kv-dtype {kv_dtype!r}; choose from {', '.join(KV_DTYPES)}") from None


#: Bytes of the Mamba state's elements: the model's dtype under vLLM's ``--dtype auto`` and
#: ``--mamba-cache-dtype auto`` (``--kv-dtype`` does not apply to it).
_STATE_BYTES = 2


def sizing_from_config(cfg: dict[str, Any], name: str, kv_dtype: str = "auto") -> KVSizing:
    """The sizing of a model from its ``config.json`` fields.

    Raises:
        ReplayError: a needed field missing, not a JSON integer, or below its least value
            (named: 1 for counts and sizes, 0 for ``attn_layer_offset``), an unknown
            ``kv_dtype``.
    """
    nbytes = _dtype_bytes(kv_dtype)
    layers = _need(cfg, "num_hidden_layers", name)
    if cfg.get("kv_lora_rank") is not None or str(cfg.get("model_type", "")).startswith("deepseek_v"):
        rank = _need(cfg, "kv_lora_rank", name)
        rope = _need(cfg, "qk_rope_head_dim", name)
        return KVSizing(name, "mla", kv_dtype, nbytes, layers * (rank + rope) * nbytes, layers, 0, None, 0, 0,
                        f"MLA: {layers} layers x ({rank} kv_lora_rank + {rope} qk_rope_head_dim) x {nbytes} bytes")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is None:
        kv_heads = _need(cfg, "num_attention_heads", name)
    kv_heads = _count(kv_heads, "num_key_value_heads", name)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden, heads = _need(cfg, "hidden_size", name), _need(cfg, "num_attention_heads", name)
        if hidden < heads:
            raise ReplayError(f"{name}: config.json hidden_size {hidden} is smaller than num_attention_heads "
                              f"{heads} (head_dim would be 0)")
        head_dim = hidden // heads
    head_dim = _count(head_dim, "head_dim", name)
    attn_layers, mamba_layers, mamba_state = layers, 0, 0
    mtype = str(cfg.get("model_type", ""))
    sbytes = _STATE_BYTES
    if mtype == "jamba":
        period = _need(cfg, "attn_layer_period", name)
        offset = _need(cfg, "attn_layer_offset", name, minimum=0)
        attn_layers = sum(1 for i in range(layers) if i % period == offset)
        mamba_layers = layers - attn_layers
        inter = _need(cfg, "mamba_expand", name) * _need(cfg, "hidden_size", name)
        d_state, d_conv = _need(cfg, "mamba_d_state", name), _need(cfg, "mamba_d_conv", name)
        # vLLM's mamba1_state_shape: conv (d_conv - 1, intermediate), ssm (intermediate, d_state)
        mamba_state = mamba_layers * (inter * (d_conv - 1) + inter * d_state) * sbytes
    elif mtype.startswith("nemotron_h") or cfg.get("hybrid_override_pattern") is not None:
        pattern = cfg.get("hybrid_override_pattern")
        if not isinstance(pattern, str):
            raise ReplayError(f"{name}: config.json has no 'hybrid_override_pattern' (needed to size the KV cache)")
        attn_layers, mamba_layers = pattern.count("*"), pattern.count("M")
        nheads, hdim = _need(cfg, "mamba_num_heads", name), _need(cfg, "mamba_head_dim", name)
        d_state, groups = _need(cfg, "ssm_state_size", name), _need(cfg, "n_groups", name)
        d_conv = _need(cfg, "conv_kernel", name)
        conv_dim = nheads * hdim + 2 * groups * d_state
        # vLLM's mamba2_state_shape: conv (d_conv - 1, conv_dim), ssm (heads, head_dim, d_state)
        mamba_state = mamba_layers * (conv_dim * (d_conv - 1) + nheads * hdim * d_state) * sbytes
    window = cfg.get("sliding_window")
    if window is not None:
        window = _count(window, "sliding_window", name)
    swa = 0
    if isinstance(cfg.get("layer_types"), list):
        swa = sum(1 for t in cfg["layer_types"] if t == "sliding_attention")
    elif window is not None and cfg.get("use_sliding_window", True) is not False:
        swa = attn_layers
    per_token = 2 * attn_layers * kv_heads * head_dim * nbytes
    formula = f"2 x {attn_layers} layers x {kv_heads} KV heads x {head_dim} head_dim x {nbytes} bytes"
    return KVSizing(name, "hybrid-mamba" if mamba_layers else "full", kv_dtype, nbytes, per_token, attn_layers,
                    swa, window if swa else None, mamba_layers, mamba_state, formula)


def load_sizing(model: str, kv_dtype: str = "auto") -> KVSizing:
    """``--model``: a catalog name (case-insensitive) or a local ``config.json`` (or a folder
    holding one).

    Raises:
        ReplayError: an unknown name (the catalog listed), an unreadable config, a field missing.
    """
    _dtype_bytes(kv_dtype)
    by_lower = {k.lower(): k for k in CATALOG}
    if model.lower() in by_lower:
        name = by_lower[model.lower()]
        return sizing_from_config(CATALOG[name], name, kv_dtype)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ReplayError(f"unknown --model {model!r}: not a config.json path nor one of {', '.join(CATALOG)}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReplayError(f"{path}: cannot read config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise ReplayError(f"{path}: config.json is not a JSON object")
    if isinstance(cfg.get("text_config"), dict):  # multimodal configs nest the language model's
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k == "torch_dtype"}}
    return sizing_from_config(cfg, str(path), kv_dtype)


def check_budget(text: str, blocks: int, sizing: KVSizing, block_size: int) -> None:
    """A budget too small for 2 blocks is an error (block 0 is vLLM's null block)."""
    if blocks < 2:
        need = sizing.budget_of(2, block_size)
        raise ReplayError(f"capacity {text} is too small for {sizing.model}: 2 blocks of {block_size} tokens "
                          f"need {format_bytes(need)} ({need:,} bytes)")
    if blocks > MAX_NUM_BLOCKS:
        raise ReplayError(f"capacity {text} is too large: {blocks:,} blocks of {block_size} tokens, at most "
                          f"{MAX_NUM_BLOCKS:,} (int32 block ids)")


def resolve_capacities(specs: list[str], sizing: KVSizing | None,
                       block_size: int) -> tuple[list[int | None], list[str]]:
    """``--capacities``: block counts (``10k``, ``inf``) and budgets in bytes (``8GiB``, with
    ``--model``), as ``num_blocks`` sorted ascending (unlimited last, one per block count) and
    each one's label (the budget as given, or the block count).

    Raises:
        ReplayError: no capacity, a budget without ``--model``, one under 2 blocks, a bad
            block count.
    """
    budgets: dict[int, str] = {}
    counts: list[str] = []
    for spec in specs:
        for part in str(spec).split(","):
            s = part.strip()
            if not s:
                continue
            nbytes = parse_bytes(s)
            if nbytes is None:
                counts.append(s)
                continue
            if sizing is None:
                raise ReplayError(f"capacity {s} is in bytes: give --model (a config.json or one of "
                                  f"{', '.join(CATALOG)}) to turn it into blocks")
            blocks = sizing.blocks_for(nbytes, block_size)
            check_budget(s, blocks, sizing, block_size)
            budgets.setdefault(blocks, s)
    caps: set[int | None] = set(parse_capacities(counts)) if counts else set()
    caps |= set(budgets)
    finite = sorted(c for c in caps if c is not None)
    ordered: list[int | None] = [*finite, *([None] if None in caps else [])]
    if not ordered:
        raise ReplayError("--capacities: no capacity given; expected block counts such as 1k,10k,inf"
                          + (" or byte sizes such as 8GiB" if sizing is not None else ""))
    labels = ["unlimited" if c is None else budgets.get(c, f"{c:,}") for c in ordered]
    return ordered, labels
