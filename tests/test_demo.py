"""The paged-attention serving demo: prefix caching on vs off gives identical greedy tokens,
logits within 1e-4 and exactly the reported hit count of saved prefill, on the CPU (and on
CUDA when present). Sabotaged runs show the checks can fail."""

from __future__ import annotations

import json

import pytest
from conftest import require_module

torch = require_module("torch")

import kvblock.hashing as kh  # noqa: E402
from kvblock.worker.block_table import BlockTable  # noqa: E402
from kvblock.worker.demo import (  # noqa: E402
    DemoConfig,
    ModelConfig,
    TinyDecoder,
    compare_results,
    main,
    make_workload,
    run_demo,
    serve,
)
from kvblock.manager import KVCacheManager  # noqa: E402

SMALL_MODEL = ModelConfig(vocab_size=128, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)


def small_config(**kw) -> DemoConfig:
    base = dict(
        model=SMALL_MODEL, num_conversations=4, num_turns=3, system_len=20, question_len=(3, 9),
        max_tokens=5, block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
        verify_dense=True,
    )
    base.update(kw)
    return DemoConfig(**base)


@pytest.fixture(autouse=True)
def restore_none_hash():
    """The manager initialises the process-wide root hash; put it back afterwards."""
    saved = (kh.NONE_HASH, kh._NONE_HASH_SEED, kh._NONE_HASH_ALGO)
    yield
    kh.NONE_HASH, kh._NONE_HASH_SEED, kh._NONE_HASH_ALGO = saved


def assert_equivalent(rep) -> None:
    assert rep.ok, rep.failures
    assert rep.tokens_identical
    assert rep.max_logits_diff <= 1e-4
    assert rep.on.max_dense_logits_diff <= 1e-4 and rep.off.max_dense_logits_diff <= 1e-4
    n_requests = sum(len(q) for q in make_workload(4, 3, 20, (3, 9), 5, 128).questions)
    assert len(rep.on.outputs) == len(rep.off.outputs) == n_requests
    assert all(len(v) == 5 for v in rep.on.outputs.values())
    assert rep.off.reported_hits == 0 and rep.off.hit_tokens == 0
    assert rep.on.decode_tokens_computed == rep.off.decode_tokens_computed or rep.on.num_preemptions or rep.off.num_preemptions


def test_caching_on_off_equivalence_cpu():
    rep = run_demo("cpu", small_config())
    assert_equivalent(rep)
    on, off = rep.on, rep.off
    assert on.num_preemptions == off.num_preemptions == 0
    # Caching saved real work, and exactly the reported hit count.
    assert on.reported_hits > 100
    assert rep.prefill_saved == on.reported_hits == on.hit_tokens
    assert off.prefill_tokens_computed == off.admitted_tokens == on.admitted_tokens
    assert on.prefill_tokens_computed == on.admitted_tokens - on.reported_hits
    # The stats are vLLM's: queries count every admitted token.
    assert on.stats.queries == on.admitted_tokens and on.stats.requests == len(on.outputs)
    # Multi-turn: each later turn extends the previous turn's prompt and outputs.
    assert on.prompts["c0-t1"][: len(on.prompts["c0-t0"]) + 5] == on.prompts["c0-t0"] + on.outputs["c0-t0"]
    # The duplicated first question (last conversation) generates the same answer.
    assert on.outputs["c3-t0"] == on.outputs["c0-t0"]
    # The greedy outputs are not degenerate.
    assert len({t for v in on.outputs.values() for t in v}) > 10


def test_chunked_prefill_kernel_blocks_and_single_step_budget_agree():
    """Smaller token budgets (chunked prefill) and half-size kernel blocks change the
    schedule, not the tokens."""
    base = run_demo("cpu", small_config(verify_dense=False))
    for kw in (dict(max_num_batched_tokens=7), dict(kernel_block_size=2), dict(kernel_block_size=1, max_num_seqs=2)):
        rep = run_demo("cpu", small_config(**kw))
        assert_equivalent(rep)
        assert rep.on.outputs == base.on.outputs
        assert max(float((rep.on.logits[k] - base.on.logits[k]).abs().max()) for k in base.on.logits) <= 1e-4


def test_preemption_keeps_outputs():
    """A pool too small for every conversation at once forces recompute preemptions (and,
    with caching on, evictions of cached blocks); outputs still match."""
    rep = run_demo("cpu", small_config(num_blocks=20, max_num_batched_tokens=16))
    assert_equivalent(rep)
    assert rep.on.num_preemptions > 0 and rep.off.num_preemptions > 0
    for res in (rep.on, rep.off):
        assert res.prefill_tokens_computed == res.admitted_tokens - res.reported_hits - res.abandoned_prefill_tokens
    assert rep.on.stats.preempted_requests > 0
    assert rep.on.prefill_tokens_computed < rep.off.prefill_tokens_computed


def test_paged_forward_matches_dense_and_the_block_table_is_used():
    model = TinyDecoder(SMALL_MODEL)
    res = serve(model, make_workload(2, 2, 12, (3, 5), 4, 128, seed=3), enable_caching=True,
                block_size=4, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, verify_dense=True)
    assert res.max_dense_logits_diff <= 1e-4
    ids = res.prompts["c0-t0"] + res.outputs["c0-t0"]
    dense = model.forward_dense(ids[:-1])
    assert torch.equal(dense[-4:].argmax(-1), torch.tensor(res.outputs["c0-t0"]))


def test_sabotaged_cache_is_detected(monkeypatch):
    """Zeroing a request's KV blocks when it is freed breaks what prefix caching relies on
    (a hit must find the KV its hash promises): the caching-on run then reads zeros for its
    hits and the comparison fails. Caching off never reads freed blocks, so it is unaffected."""
    caches: list = []
    real_new = TinyDecoder.new_kv_caches

    def keep(self, num_blocks, block_size):
        kv = real_new(self, num_blocks, block_size)
        caches[:] = kv
        return kv

    real_free = KVCacheManager.free

    def free_and_wipe(self, request):
        blocks = self.get_block_ids(request.request_id)[0]
        for k, v in caches:
            k[blocks] = 0
            v[blocks] = 0
        return real_free(self, request)

    monkeypatch.setattr(TinyDecoder, "new_kv_caches", keep)
    monkeypatch.setattr(KVCacheManager, "free", free_and_wipe)
    cfg = small_config(verify_dense=True)
    model = TinyDecoder(cfg.model)
    wl = make_workload(4, 3, 20, (3, 9), 5, 128)
    kw = dict(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64, verify_dense=True)
    on = serve(model, wl, enable_caching=True, **kw)
    off = serve(model, wl, enable_caching=False, **kw)
    assert off.max_dense_logits_diff <= 1e-4
    assert on.max_dense_logits_diff > 1e-2
    rep = compare_results(on, off)
    assert not rep.ok and any("logits differ" in f for f in rep.failures)


def test_wrong_slot_mapping_is_detected(monkeypatch):
    """Writing K/V one slot off (an off-by-one in the slot mapping) is caught by the dense
    reference."""
    real = BlockTable.compute_slot_mapping

    def shifted(self, *a, **k):
        out = real(self, *a, **k)
        n = int((out >= 0).sum())
        out[:n] = torch.where(out[:n] % self.block_size == self.block_size - 1, out[:n] - 1, out[:n] + 1)
        return out

    monkeypatch.setattr(BlockTable, "compute_slot_mapping", shifted)
    model = TinyDecoder(SMALL_MODEL)
    res = serve(model, make_workload(2, 1, 12, (3, 5), 4, 128), enable_caching=False,
                block_size=4, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, verify_dense=True)
    assert res.max_dense_logits_diff > 1e-2


def test_demo_main_json(capsys):
    args = ["--device", "cpu", "--conversations", "2", "--turns", "2", "--system-len", "10",
            "--max-tokens", "3", "--block-size", "4", "--num-blocks", "64", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["tokens_identical"] is True
    assert out["prefill_saved"] > 0
    rows = {r[0]: r[1:] for r in out["rows"]}
    assert rows["reported hit tokens"][0] == str(out["prefill_saved"])


def test_demo_main_table(capsys):
    assert main(["--conversations", "2", "--turns", "1", "--system-len", "8", "--max-tokens", "2", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "prefill tokens computed" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_caching_on_off_equivalence_cuda():
    rep = run_demo("cuda", small_config())
    assert_equivalent(rep)
    cpu = run_demo("cpu", small_config())
    assert cpu.on.outputs == rep.on.outputs
