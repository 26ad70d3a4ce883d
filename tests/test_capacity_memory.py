"""Budgets in bytes (kvblock.replay.memory, ``kvblock sweep --model``).

What is proven: each catalog model's bytes per token equals vLLM's own sizing, the
``page_size_bytes`` of the layer specs vLLM builds for it (``FullAttentionSpec``,
``MLAAttentionSpec``, ``MambaSpec`` with ``MambaStateShapeCalculator``'s shapes) summed over
the layers and divided by the block size; a budget turns into ``budget // bytes_per_block``
blocks as in vLLM's ``get_kv_cache_config_from_groups``; the CLI prints the sizing and the
points equal those of the same sweep given in blocks; bad input is one line and exit 2.
"""

from __future__ import annotations

import json

import pytest

from kvblock.cli import main
from kvblock.replay.errors import ReplayError
from kvblock.replay.memory import CATALOG, load_sizing, parse_bytes, resolve_capacities, sizing_from_config

from conftest import IN_CI, shared_path

TRACE = "mooncake_fast25_conversation_trace.jsonl"


def _vllm_bytes_per_token(name: str, kv_dtype: str, block_size: int = 16) -> tuple[int, int]:
    """(bytes per token, Mamba state per request) from vLLM's specs."""
    if IN_CI:
        import torch
        from vllm.v1 import kv_cache_interface as kvi
    else:
        torch = pytest.importorskip("torch")
        kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    cfg = CATALOG[name]
    dtype = {"auto": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}[kv_dtype]
    layers = cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:
        spec = kvi.MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                    head_size=cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], dtype=dtype)
        return layers * spec.page_size_bytes // block_size, 0
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = layers
    state = 0
    if cfg["model_type"] == "jamba":
        attn = sum(1 for i in range(layers) if i % cfg["attn_layer_period"] == cfg["attn_layer_offset"])
        shapes = MambaStateShapeCalculator.mamba1_state_shape(
            1, cfg["mamba_expand"] * cfg["hidden_size"], cfg["mamba_d_state"], cfg["mamba_d_conv"])
        mamba = kvi.MambaSpec(block_size=block_size, shapes=shapes, dtypes=(torch.bfloat16, torch.bfloat16))
        state = (layers - attn) * mamba.page_size_bytes
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        spec = kvi.SlidingWindowSpec(block_size=block_size, num_kv_heads=cfg["num_key_value_heads"],
                                     head_size=head_dim, dtype=dtype, sliding_window=cfg["sliding_window"])
    else:
        spec = kvi.FullAttentionSpec(block_size=block_size, num_kv_heads=cfg["num_key_value_heads"],
                                     head_size=head_dim, dtype=dtype)
    return attn * spec.page_size_bytes // block_size, state


@pytest.mark.parametrize("name", sorted(CATALOG))
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_catalog_equals_vllm_page_sizes(name: str, kv_dtype: str) -> None:
    want, state = _vllm_bytes_per_token(name, kv_dtype)
    got = load_sizing(name, kv_dtype)
    assert (got.bytes_per_token, got.mamba_state_bytes) == (want, state)
    # vLLM's num_blocks = available_memory // bytes_per_block
    budget = 8 * 2**30
    assert got.blocks_for(budget, 16) == (budget - state) // (want * 16)


def test_known_sizes_and_kinds() -> None:
    """A few sizes anyone can check by hand (2 x layers x kv_heads x head_dim x bytes)."""
    assert load_sizing("llama-3.1-8b").bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert load_sizing("Llama-3.1-70B", "fp8").bytes_per_token == 2 * 80 * 8 * 128
    assert load_sizing("DeepSeek-V3").kind == "mla"
    assert load_sizing("Mistral-7B").sliding_window_layers == 32
    jamba = load_sizing("Jamba-v0.1")
    assert (jamba.kind, jamba.attention_layers, jamba.mamba_layers) == ("hybrid-mamba", 4, 28)


def test_config_json_path(tmp_path) -> None:
    qwen = shared_path("vllm", "hf-configs", "Qwen", "Qwen3-0.6B")
    s = load_sizing(str(qwen))  # a folder holding config.json
    cfg = json.loads((qwen / "config.json").read_text())
    assert s.bytes_per_token == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"num_hidden_layers": 4, "num_key_value_heads": 2}))
    with pytest.raises(ReplayError, match="'hidden_size'"):
        load_sizing(str(bad))
    nemo = {"model_type": "nemotron_h", "num_hidden_layers": 6, "hybrid_override_pattern": "M-M*M-",
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 4,
            "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 2}
    with pytest.raises(ReplayError, match="'conv_kernel'"):
        sizing_from_config(nemo, "nemo")
    s = sizing_from_config({**nemo, "conv_kernel": 4}, "nemo")
    assert (s.attention_layers, s.mamba_layers) == (1, 3)
    assert s.mamba_state_bytes == 3 * ((4 * 16 + 2 * 2 * 8) * 3 + 4 * 16 * 8) * 2


def test_resolve_capacities() -> None:
    s = load_sizing("Llama-3.1-8B")
    caps, labels = resolve_capacities(["1GiB,8GiB", "100,inf"], s, 16)
    assert caps == [100, 512, 4096, None] and labels == ["100", "1GiB", "8GiB", "unlimited"]
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("10k") is None
    with pytest.raises(ReplayError, match="--model"):
        resolve_capacities(["1GiB"], None, 16)


def test_cli_budgets_equal_block_counts(capsys) -> None:
    trace = str(shared_path("traces", TRACE))
    common = [trace, "--limit", "300", "--no-progress", "--json", "--retention", "lru,optimal"]
    assert main(["sweep", *common, "--model", "Qwen3-8B", "--capacities", "256MiB,2GiB,inf"]) == 0
    by_bytes = json.loads(capsys.readouterr().out)
    blocks = [2**28 // (147456 * 16), 2**31 // (147456 * 16)]
    assert main(["sweep", *common, "--capacities", f"{blocks[0]},{blocks[1]},inf"]) == 0
    by_blocks = json.loads(capsys.readouterr().out)
    assert by_bytes["model"]["bytes_per_token"] == 147456
    for a, b in zip(by_bytes["series"], by_blocks["series"]):
        pa = [{k: v for k, v in p.items() if k not in ("memory_bytes", "cached_tokens", "prefill_speedup")}
              for p in a["points"]]
        assert pa == b["points"]
        for p in a["points"]:
            assert p["prefill_speedup"] == pytest.approx(1 / (1 - p["hit_rate"]))
    assert main(["sweep", trace, "--limit", "50", "--no-progress", "--model", "Qwen3-8B",
                 "--capacities", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "147,456 bytes/token" in out and "1GiB" in out


@pytest.mark.parametrize("args,msg", [
    (["--model", "Llama-9"], "not a config.json path nor one of Llama-3.1-8B"),
    (["--capacities", "8GiB"], "give --model"),
    (["--model", "Qwen3-8B", "--kv-dtype", "int3"], "unknown --kv-dtype"),
    (["--model", "Qwen3-8B", "--capacities", "1MiB"], "too small"),
    (["--warmup", "1", "--capacities", "1k"], "--warmup must be in [0, 1), got 1.0"),
    (["--warmup", "-0.25", "--capacities", "1k"], "--warmup must be in [0, 1), got -0.25"),
    (["--warmup", "nan", "--capacities", "1k", "--retention", "lru,optimal"], "--warmup must be in [0, 1)"),
])
def test_cli_bad_input(args: list[str], msg: str, capsys) -> None:
    trace = str(shared_path("traces", TRACE))
    argv = ["sweep", trace, "--limit", "10", "--no-progress", *args]
    if "--capacities" not in args:
        argv += ["--capacities", "1GiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvblock: error: ") and msg in err and err.count("\n") == 1, err


def test_cli_config_missing_field(tmp_path, capsys) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512}))
    trace = str(shared_path("traces", TRACE))
    assert main(["sweep", trace, "--limit", "10", "--model", str(cfg), "--capacities", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "'qk_rope_head_dim'" in err and err.count("\n") == 1



_LLAMA = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "hidden_size": 4096}


@pytest.mark.parametrize("field,value,msg", [
    ("num_attention_heads", 0, "'num_attention_heads' must be >= 1, got 0"),
    ("num_key_value_heads", 0, "'num_key_value_heads' must be >= 1, got 0"),
    ("head_dim", 0, "'head_dim' must be >= 1, got 0"),
    ("num_hidden_layers", -32, "'num_hidden_layers' must be >= 1, got -32"),
    ("num_hidden_layers", "32", "'num_hidden_layers' is not an integer: '32'"),
    ("num_hidden_layers", 32.5, "'num_hidden_layers' is not an integer: 32.5"),
    ("num_key_value_heads", True, "'num_key_value_heads' is not an integer: True"),
    ("hidden_size", 16, "hidden_size 16 is smaller than num_attention_heads 32"),
    ("sliding_window", 0, "'sliding_window' must be >= 1, got 0"),
])
def test_cli_config_bad_values_are_one_line(tmp_path, capsys, field, value, msg) -> None:
    """A value no model has (0 heads, negative layers, a string) is one ``kvblock: error:``
    line naming the field, exit 2: it used to be a ZeroDivisionError traceback, a negative
    byte count, or accepted."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**_LLAMA, field: value}))
    assert main(["sweep", "builtin:chat", "--limit", "10", "--model", str(cfg), "--capacities", "1GiB",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvblock: error:") and msg in err and err.count("\n") == 1, err
    with pytest.raises(ReplayError, match="config.json"):
        sizing_from_config({**_LLAMA, field: value}, "m")
    assert sizing_from_config(_LLAMA, "m").bytes_per_token == 2 * 32 * 8 * 128 * 2
