"""Trace formats of ``kvblock replay``: token expansion, loaders, bad lines, block hashes.

The expansion is checked against the shared traces README's own pure-Python definition, and the
memoised block hashes against ``get_request_block_hasher`` run on the expanded tokens.
"""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest

from kvblock import Request
from kvblock import hashing as kv_hashing
from kvblock.reference import hashing as ref_hashing
from kvblock.replay import ReplayError, TraceFormatError, get_impl, load_trace
from kvblock.replay.blockhash import RequestHasher
from kvblock.replay.expand import HashIdExpander, expand_block_tokens, synthetic_output_tokens
from kvblock.replay.loader import detect_format
from kvblock.replay.trace import TraceRequest

M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The shared traces README's definition, verbatim."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def readme_block_tokens(h: int, b: int = 512) -> list[int]:
    return [1000 + splitmix64(h * b + j) % 32000 for j in range(b)]


def readme_prompt_tokens(rec: dict, b: int = 512) -> list[int]:
    toks: list[int] = []
    for h in rec["hash_ids"]:
        toks.extend(readme_block_tokens(h, b))
    return toks[: rec["input_length"]]


def write_jsonl(path, lines) -> str:
    with open(path, "w") as f:
        for line in lines:
            f.write(line if isinstance(line, str) else json.dumps(line))
            f.write("\n")
    return str(path)


def mooncake(ts, n_in, n_out, ids) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


# -- expansion --------------------------------------------------------------------------------

@pytest.mark.parametrize("ids", [[0], [1, 2, 3], [182789, 7, 0], [2**40 + 5]])
def test_expansion_matches_the_readme_definition(ids):
    got = expand_block_tokens(np.array(ids), 512)
    assert got.shape == (len(ids), 512) and got.dtype == np.int64
    for row, h in zip(got, ids):
        assert row.tolist() == readme_block_tokens(h)


def test_expansion_other_trace_block_size_and_prompt_cut():
    exp = HashIdExpander(16)
    assert exp.block_tokens(np.array([9, 4])).tolist() == [readme_block_tokens(9, 16), readme_block_tokens(4, 16)]
    rec = {"hash_ids": [3, 1, 4], "input_length": 40}
    assert exp.prompt_tokens(np.array(rec["hash_ids"]), 40).tolist() == readme_prompt_tokens(rec, 16)


def test_expander_cache_is_bounded_and_consistent():
    exp = HashIdExpander(512, cache_tokens=2 * 512)
    first = exp.block_tokens(np.array([1, 2, 1, 3]))
    assert len(exp._cache) == 2
    again = exp.block_tokens(np.array([3, 1, 2]))
    assert np.array_equal(again, first[[3, 0, 1]])
    uncached = HashIdExpander(512, cache_tokens=0)
    assert np.array_equal(uncached.block_tokens(np.array([1, 2, 1, 3])), first) and not uncached._cache


def test_synthetic_outputs_are_unique_per_request_and_in_vocab():
    a, b = synthetic_output_tokens(0, 300), synthetic_output_tokens(1, 300)
    assert a.tolist() != b.tolist()
    assert a.min() >= 1000 and a.max() < 33000
    assert np.array_equal(a[:10], synthetic_output_tokens(0, 10))


# -- block hashes -------------------------------------------------------------------------------

RECORDS = [
    mooncake(0, 1500, 3, [0, 1, 2]),        # partial last block (476 tokens)
    mooncake(0, 1024, 3, [0, 1]),           # a prefix of the first, block aligned
    mooncake(1, 2000, 3, [0, 1, 5, 6]),     # shares two trace blocks, then new ones
    mooncake(2, 1500, 3, [0, 1, 2]),        # identical to the first
    mooncake(3, 1600, 3, [0, 1, 2, 9]),     # extends the first: id 2 full this time
    mooncake(4, 7, 3, [11]),                # shorter than one kvblock block
    mooncake(5, 700, 3, [12, 2]),           # id 2 after another parent (not a prefix trace)
]


def trace_requests(records, tbs=512):
    return [
        TraceRequest(index=i, request_id=f"req-{i}", arrival_ms=float(r["timestamp"]), prompt_len=r["input_length"],
                     output_len=r["output_length"], hash_ids=np.array(r["hash_ids"], dtype=np.int64))
        for i, r in enumerate(records)
    ]


@pytest.mark.parametrize("block_size", [16, 32, 64, 512, 48, 1000])
@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_block_hashes_equal_the_request_block_hasher(block_size, algo, seed_env):
    seed_env("0")
    fn = kv_hashing.get_hash_fn_by_name(algo)
    kv_hashing.init_none_hash(fn)
    hasher = RequestHasher(get_impl("kvblock"), block_size, algo, 512)
    hasher.start_run()
    assert hasher.memoised == (512 % block_size == 0)
    reference = kv_hashing.get_request_block_hasher(block_size, fn)
    for run in range(2):  # the second pass is served from the memo
        for rec, tr in zip(RECORDS, trace_requests(RECORDS)):
            expected = Request(tr.request_id, readme_prompt_tokens(rec), block_hasher=reference).block_hashes
            assert hasher.prompt_hashes(tr) == expected, (run, rec)
    if hasher.memoised:
        # one entry per distinct (parent, id) hashed: ids 0 1 2 5 6 9 12, and 2 again after 12;
        # the 7-token request has no full block and hashes nothing; with 512-token blocks the
        # request ending in id 9 needs no block of it (its 64 tokens are not a full block)
        assert hasher.blocks_reused > 0
        assert hasher.memo_entries == (7 if block_size == 512 else 8)


def test_reference_impl_hashes_identically(seed_env):
    seed_env("0")
    kv_hashing.init_none_hash(kv_hashing.sha256)
    ref_hashing.init_none_hash(ref_hashing.sha256)
    kv = RequestHasher(get_impl("kvblock"), 16, "sha256", 512)
    ref = RequestHasher(get_impl("reference"), 16, "sha256", 512)
    kv.start_run()
    ref.start_run()
    for tr in trace_requests(RECORDS):
        assert kv.prompt_hashes(tr) == ref.prompt_hashes(tr)
    assert ref.blocks_hashed == kv.blocks_hashed and ref.hash_ns > 0


def test_output_blocks_chain_from_the_prompt(seed_env):
    """tail_tokens + chain reproduce the hashes of prompt + synthetic outputs."""
    seed_env("0")
    kv_hashing.init_none_hash(kv_hashing.sha256)
    hasher = RequestHasher(get_impl("kvblock"), 16, "sha256", 512)
    hasher.start_run()
    rec = mooncake(0, 1500, 40, [0, 1, 2])
    tr = trace_requests([rec])[0]
    hashes = hasher.prompt_hashes(tr)
    tail = hasher.tail_tokens(tr)
    assert len(tail) == 1500 - 93 * 16 + 40
    hashes = hashes + hasher.chain(hashes[-1], tail[: (len(tail) // 16) * 16])
    tokens = readme_prompt_tokens(rec) + synthetic_output_tokens(0, 40).tolist()
    expected = Request("x", tokens, block_hasher=kv_hashing.get_request_block_hasher(16, kv_hashing.sha256)).block_hashes
    assert hashes == expected


def test_memo_is_dropped_when_the_root_changes(seed_env):
    seed_env("0")
    kv_hashing.init_none_hash(kv_hashing.sha256)
    hasher = RequestHasher(get_impl("kvblock"), 16, "sha256", 512)
    hasher.start_run()
    tr = trace_requests(RECORDS)[0]
    first = hasher.prompt_hashes(tr)
    seed_env("1")
    kv_hashing.init_none_hash(kv_hashing.sha256)
    hasher.start_run()
    assert hasher.memo_entries == 0
    second = hasher.prompt_hashes(tr)
    assert second != first and hasher.blocks_reused == 0


# -- loaders ----------------------------------------------------------------------------------

def test_mooncake_loader_sorts_stably_and_keeps_lines(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        mooncake(5, 600, 1, [0, 1]), "", mooncake(0, 512, 2, [7]), mooncake(5, 10, 3, [9]),
    ])
    assert detect_format(path) == "mooncake"
    t = load_trace(path)
    assert t.name == "t" and t.format == "mooncake" and t.trace_block_size == 512
    assert [r.request_id for r in t.requests] == ["req-1", "req-0", "req-2"]
    assert [r.line for r in t.requests] == [3, 1, 4]
    assert t.requests[1].hash_ids.tolist() == [0, 1] and t.requests[1].output_len == 1
    assert t.num_prompt_tokens == 1122
    assert [r.request_id for r in load_trace(path, limit=2).requests] == ["req-1", "req-0"]


def test_gzip_trace(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(mooncake(0, 600, 1, [0, 1])) + "\n")
    t = load_trace(str(path))
    assert t.name == "t" and t.requests[0].prompt_len == 600


def test_bailian_loader(tmp_path):
    line = {"chat_id": 7, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 40, "output_length": 9,
            "type": "text", "turn": 1, "hash_ids": [3, 1, 4]}
    path = write_jsonl(tmp_path / "b.jsonl", [line])
    t = load_trace(path)
    assert t.format == "bailian" and t.trace_block_size == 16
    r = t.requests[0]
    assert r.arrival_ms == 1500.0 and r.session == 7 and r.prompt_len == 40
    # --trace-block-size selects the block size a hash-id trace was made with
    path2 = write_jsonl(tmp_path / "m16.jsonl", [mooncake(0, 40, 1, [3, 1, 4])])
    assert load_trace(path2, trace_block_size=16).trace_block_size == 16
    with pytest.raises(TraceFormatError, match="needs ceil"):
        load_trace(path2)


def test_token_trace_loader(tmp_path):
    path = write_jsonl(tmp_path / "tok.jsonl", [
        [5, 6, 7],
        {"prompt_token_ids": [1, 2], "output_length": 4, "timestamp": 3.0},
        {"token_ids": [9], "output_token_ids": [8, 8], "request_id": "x"},
    ])
    t = load_trace(path)
    assert t.format == "tokens" and t.trace_block_size is None
    a, c, b = t.requests  # sorted by arrival: b arrives at 3 ms
    assert a.prompt_tokens.tolist() == [5, 6, 7] and a.output_len == 1
    assert b.output_len == 4 and b.arrival_ms == 3.0 and b.output_tokens is None
    assert c.request_id == "x" and c.output_len == 2 and c.output_tokens.tolist() == [8, 8]


BAD_LINES = [
    ('{"timestamp": 0, "input_length": 5', "malformed JSON"),
    ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}', "Expected `int`, got `str`"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing required field `hash_ids`"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "input_length must be > 0"),
    ('{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [0]}', "output_length must be >= 0"),
    ('{"timestamp": -3, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "timestamp must be"),
    ('{"timestamp": 1e300, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
     "timestamp must be at most 31,622,400,000 ms (366 days after the trace start), got 1e+300"),
    ('{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1]}', "hash_ids has 2 ids but input_length 1500 needs ceil(1500/512) = 3"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids must be in"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [99999999999999999999]}', ""),
]


@pytest.mark.parametrize("bad,reason", BAD_LINES)
def test_bad_mooncake_line_reports_its_line_number(tmp_path, bad, reason):
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 600, 1, [0, 1]), "  ", bad, mooncake(1, 10, 1, [4])])
    with pytest.raises(TraceFormatError) as e:
        load_trace(path, format="mooncake")
    assert e.value.line == 3 and str(e.value).startswith(f"{path}:3: ")
    assert reason in str(e.value)
    t = load_trace(path, format="mooncake", skip_bad_lines=True)
    assert [r.line for r in t.requests] == [1, 4] and [b.line for b in t.bad_lines] == [3]
    assert [r.request_id for r in t.requests] == ["req-0", "req-1"]


@pytest.mark.parametrize("bad,reason", [
    ("[]", "the prompt is empty"),
    ("[1, -2]", "token ids must be >= 0"),
    ('{"output_length": 3}', "missing prompt_token_ids"),
    ('{"prompt_token_ids": [1], "token_ids": [1]}', "not both"),
    ('{"prompt_token_ids": [1], "output_length": -1}', "output_length must be >= 0"),
    ('{"prompt_token_ids": [1], "output_token_ids": [2], "output_length": 2}', "exceeds the 1 output_token_ids"),
    ('{"prompt_token_ids": [1.5]}', "Expected `int`, got `float`"),
    ('"text"', "Expected `object | array`"),
])
def test_bad_token_lines(tmp_path, bad, reason):
    path = write_jsonl(tmp_path / "t.jsonl", [[1, 2], bad])
    with pytest.raises(TraceFormatError, match=r":2: ") as e:
        load_trace(path, format="tokens")
    assert reason in str(e.value)


def test_duplicate_request_ids(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"token_ids": [1], "request_id": "a"}, {"token_ids": [2], "request_id": "a"}])
    with pytest.raises(TraceFormatError, match="duplicate request_id 'a' .first on line 1."):
        load_trace(path)


@pytest.mark.parametrize("content,message", [
    (None, "trace file not found"),
    ("", "has no requests"),
    ('{"foo": 1}\n', "cannot tell the trace format"),
    ("{bad\n", "malformed JSON"),
])
def test_unusable_files(tmp_path, content, message):
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ReplayError, match=message):
        load_trace(str(path))


def test_directory_and_option_errors(tmp_path):
    with pytest.raises(ReplayError, match="is a directory"):
        load_trace(str(tmp_path))
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 5, 1, [0])])
    with pytest.raises(ReplayError, match="unknown trace format"):
        load_trace(path, format="csv")
    with pytest.raises(ReplayError, match="--trace-block-size must be > 0"):
        load_trace(path, trace_block_size=0)
    with pytest.raises(ReplayError, match="--limit must be > 0"):
        load_trace(path, limit=0)


def test_all_lines_bad_with_skipping(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ["{x", "{y"])
    with pytest.raises(ReplayError, match=r"no valid request \(2 bad lines skipped; first on line 1"):
        load_trace(path, format="mooncake", skip_bad_lines=True)
    # the format detected first (no --format): the same message, not "has no requests"
    with pytest.raises(ReplayError, match=r"no valid request \(2 bad lines skipped; first on line 1"):
        load_trace(path, skip_bad_lines=True)


@pytest.mark.parametrize("fmt, unit, limit", [("mooncake", "ms", 31_622_400_000), ("bailian", "s", 31_622_400),
                                              ("tokens", "ms", 31_622_400_000)])
def test_timestamps_are_bounded_to_366_days_in_the_trace_unit(tmp_path, fmt, unit, limit):
    """A timestamp of 1e300 was accepted: the report's "scheduler steps" row printed a
    ~300-digit number of simulated seconds and the table grew hundreds of columns wide. Every
    format refuses a timestamp past 366 days (in its own unit) as a bad line, with its number,
    and accepts the bound itself."""
    from kvblock.replay.trace import MAX_ARRIVAL_MS

    assert MAX_ARRIVAL_MS == 366 * 24 * 3600 * 1000

    def line(ts):
        if fmt == "mooncake":
            return mooncake(ts, 5, 1, [0])
        if fmt == "bailian":
            return {"chat_id": 1, "timestamp": ts, "input_length": 5, "output_length": 1, "hash_ids": [0]}
        return {"prompt_token_ids": [1, 2], "timestamp": ts}

    ok = load_trace(write_jsonl(tmp_path / "ok.jsonl", [line(0), line(limit)]), format=fmt)
    assert ok.requests[-1].arrival_ms == MAX_ARRIVAL_MS
    for bad in (limit + 1, 1e300, 1.7e308):
        path = write_jsonl(tmp_path / "bad.jsonl", [line(0), line(bad)])
        with pytest.raises(TraceFormatError) as e:
            load_trace(path, format=fmt)
        assert e.value.line == 2 and str(e.value).startswith(f"{path}:2: ")
        assert f"timestamp must be at most {limit:,} {unit} (366 days after the trace start)" in str(e.value)
        t = load_trace(path, format=fmt, skip_bad_lines=True)
        assert [r.line for r in t.requests] == [1] and [b.line for b in t.bad_lines] == [2]


def test_hash_id_bounds_depend_on_the_trace_block_size(tmp_path):
    limit = (1 << 63) // 512
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 5, 1, [limit])])
    with pytest.raises(TraceFormatError, match=f"hash_ids must be in \\[0, {limit}\\)"):
        load_trace(path)
    assert math.isclose(load_trace(write_jsonl(tmp_path / "u.jsonl", [mooncake(0, 5, 1, [limit - 1])])).requests[0].hash_ids[0], limit - 1)
