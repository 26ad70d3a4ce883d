"""Every digest of ../shared/spec/golden_vectors.json and the workload's §6.1 table, for all
four algorithms: NONE_HASH, plain blocks, LoRA + salt, multimodal, serialized bytes, group-id
keys and event ints."""

from __future__ import annotations

import ast

import pytest

import kvblock
from kvblock import hashing as H
from kvblock.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request
from kvblock.reference import hashing as R


def _cases(golden):
    return {c["algo"]: c for c in golden["cases"]}


@pytest.mark.parametrize("algo", H.ALGORITHMS)
def test_none_hash_and_serialization(golden, algo):
    c = _cases(golden)[algo]
    fn = H.get_hash_fn_by_name(algo)
    seed = c["none_hash_seed_string"]
    assert fn.serialize(seed).hex() == c["none_hash_serialized_hex"]
    assert fn(seed).hex() == c["NONE_HASH_hex"]
    assert fn.digest_size == c["digest_len"]


@pytest.mark.parametrize("algo", H.ALGORITHMS)
def test_plain_blocks(golden, algo):
    c = _cases(golden)[algo]
    a = c["A_plain"]
    fn = H.get_hash_fn_by_name(algo)
    root = bytes.fromhex(c["NONE_HASH_hex"])
    toks = a["block0_tokens"] + a["block1_tokens"]
    assert fn.serialize((root, tuple(a["block0_tokens"]), None)).hex() == a["block0_serialized_hex"]
    h = kvblock.hash_blocks(toks, a["block_size"], algo=algo, parent=root)
    assert [x.hex() for x in h] == [a["block0_hash_hex"], a["block1_hash_hex"]]
    # the per-block vLLM API gives the same chain
    b0 = H.hash_block_tokens(fn, root, a["block0_tokens"])
    b1 = H.hash_block_tokens(fn, b0, a["block1_tokens"], None)
    assert [b0, b1] == h
    assert H.make_block_hash_with_group_id(h[1], 3).hex() == a["block1_with_group_id_3_hex"]
    assert H.get_group_id(H.make_block_hash_with_group_id(h[1], 3)) == 3
    assert H.get_block_hash(H.make_block_hash_with_group_id(h[1], 3)) == h[1]


def _request(prompt, hasher, **kw):
    return Request("r", prompt, block_hasher=hasher, **kw)


@pytest.mark.parametrize("algo", H.ALGORITHMS)
def test_lora_salt_and_multimodal(golden, algo, monkeypatch):
    c = _cases(golden)[algo]
    fn = H.get_hash_fn_by_name(algo)
    monkeypatch.setattr(H, "NONE_HASH", bytes.fromhex(c["NONE_HASH_hex"]))
    b = c["B_lora_salt"]
    lora = LoRARequest(b["lora"]["lora_name"], b["lora"]["lora_int_id"], b["lora"]["lora_path"])
    req = _request(b["prompt_token_ids"], H.get_request_block_hasher(16, fn), lora_request=lora,
                   cache_salt=b["cache_salt"])
    assert [h.hex() for h in req.block_hashes] == b["block_hashes_hex"]
    from kvblock.extra_keys import generate_block_hash_extra_keys

    assert generate_block_hash_extra_keys(req, 0, 16, 0)[0] == ast.literal_eval(b["block0_extra_keys"])
    assert generate_block_hash_extra_keys(req, 16, 32, 0)[0] == ast.literal_eval(b["block1_extra_keys"])
    keys0 = generate_block_hash_extra_keys(req, 0, 16, 0)[0]
    root = bytes.fromhex(c["NONE_HASH_hex"])
    assert fn.serialize((root, tuple(b["prompt_token_ids"][:16]), keys0)).hex() == b["block0_serialized_hex"]

    m = c["C_multimodal"]
    feats = [MultiModalFeatureSpec(x["identifier"], PlaceholderRange(x["offset"], x["length"])) for x in m["mm"]]
    req = _request(m["prompt_token_ids"], H.get_request_block_hasher(16, fn), mm_features=feats)
    assert [h.hex() for h in req.block_hashes] == m["block_hashes_hex"]
    for i, want in enumerate(m["per_block_extra_keys"]):
        got, _ = generate_block_hash_extra_keys(req, 16 * i, 16 * (i + 1), 0)
        assert got == ast.literal_eval(want)


def test_event_ints(golden):
    c = _cases(golden)["sha256"]["A_plain"]
    ints = [H.block_hash_to_event_int(bytes.fromhex(c[k])) for k in ("block0_hash_hex", "block1_hash_hex")]
    assert ints == [3262291359910021016, 7142137847444424233]
    assert H.maybe_convert_block_hash(bytes.fromhex(c["block0_hash_hex"]), use_int=False) == bytes.fromhex(
        c["block0_hash_hex"]
    )


def test_reference_matches_golden(golden, monkeypatch):
    """The pure-Python oracle reproduces the same golden chains."""
    for algo, c in _cases(golden).items():
        fn = R.get_hash_fn_by_name(algo)
        assert fn(c["none_hash_seed_string"]).hex() == c["NONE_HASH_hex"]
        a = c["A_plain"]
        h = R.hash_blocks(a["block0_tokens"] + a["block1_tokens"], 16, algo=algo,
                          parent=bytes.fromhex(c["NONE_HASH_hex"]))
        assert [x.hex() for x in h] == [a["block0_hash_hex"], a["block1_hash_hex"]]


# ../shared/workload/README.md §6.1: digest of the 256th block of the 4096-token hashing prompt.
WORKLOAD_LAST_BLOCK = {
    "none": {
        "sha256": "fb50da04b614ada030dd7640936656de1a2666f1ad9ff8df66c838dbe1dcccb2",
        "sha256_cbor": "410b79ead05f158fffa0d56874bc494afd0e57ae10aba6d99f66b3877e02ce48",
        "xxhash": "f90332d69d2b31036a3f5f1bd24947e7",
        "xxhash_cbor": "e3a692392ab84665363b60fa41d8caed",
    },
    "lora": {
        "sha256": "faf328c83673a85ba470205e1a0a862bf3db3b8a247ec813c0b975f6d77db6bf",
        "sha256_cbor": "56b492803c858eb12600e9632a6eaf5bb805567fb7acee2aa074c9b7c4a9f9e1",
        "xxhash": "66072a6278a3e824a360e56f09ff1092",
        "xxhash_cbor": "02c61d5127e72389b10b5ce3fb0e3f2a",
    },
    "lora+salt": {
        "sha256": "5dca20cd7b664c4990af4e219c428fc2b0ce89e18868217cb65242c1a8b0f0c6",
        "sha256_cbor": "b4b58d4f9ff76e6691d604cd75029b4494eac868d94af0cb010d4e4b7e037b14",
        "xxhash": "1ff23e7cb6ff05e891481623deb4bf55",
        "xxhash_cbor": "41417a2cb20568ce48ef2be80b115ea4",
    },
    "mm": {
        "sha256": "f495c4d153eb2ee6ff4c387bdc6234abac51e23a839d9f8bd777963535a1506b",
        "sha256_cbor": "20e3361afba12f308ce1817e37dfc35b3858fd47c341f7305d71b4e25dcd44a1",
        "xxhash": "6293d1b47c1c52e68d1f2f93f36a92ed",
        "xxhash_cbor": "7c85728fb5425d009e62bef08cd82d5b",
    },
}


@pytest.mark.parametrize("algo", H.ALGORITHMS)
@pytest.mark.parametrize("variant", list(WORKLOAD_LAST_BLOCK))
def test_workload_hashing_digests(workload_module, seed_env, algo, variant):
    wl = workload_module.load(str(workload_module.__file__).replace("apc_workload.py", "apc_workload.json"))
    seed_env(wl["pythonhashseed"])
    fn = H.get_hash_fn_by_name(algo)
    H.init_none_hash(fn)
    prompt = workload_module.hashing_prompt(wl)
    hw = wl["hashing"]
    lora = LoRARequest(hw["lora"]["lora_name"], hw["lora"]["lora_int_id"], hw["lora"]["lora_path"])
    if variant == "none":
        last = kvblock.hash_blocks(prompt, 16, algo=algo)[-1]
    elif variant == "lora":
        key = (("lora", "bench-lora", "/adapters/bench-lora"),)
        last = kvblock.hash_blocks(prompt, 16, algo=algo, extra_keys=[key] * 256)[-1]
    elif variant == "lora+salt":
        req = _request(prompt, H.get_request_block_hasher(16, fn), lora_request=lora, cache_salt=hw["cache_salt"])
        last = req.block_hashes[-1]
    else:
        feats = [(m["identifier"], m["offset"], m["length"]) for m in hw["mm_items"]]
        req = _request(prompt, H.get_request_block_hasher(16, fn), mm_features=feats)
        last = req.block_hashes[-1]
    assert last.hex() == WORKLOAD_LAST_BLOCK[variant][algo]
