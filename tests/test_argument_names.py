"""Errors name the argument they refuse, with the type a caller expects (new-user finding L3).

Each case raised an error that named nothing (PyO3's "can't convert negative int to
unsigned", "'int' object is not an instance of 'str'", a raw ``'<='`` comparison error), named
another argument (``num_gpu_blocks`` for ``num_blocks``) or another count (two blocks more than
asked). Each now names the argument, and changes nothing. (``Request``'s arguments:
tests/test_request_arguments.py.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvblock import KVCacheManager
from kvblock.cluster import PrefixIndex


def _index() -> PrefixIndex:
    ix = PrefixIndex(16)
    ix.store("e0", [1, 2, 3])
    return ix


def _index_state(ix: PrefixIndex) -> tuple:
    return ix.instances(), ix.num_pairs(), ix.blocks_of("e0"), ix.totals()


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda ix: ix.apply("e0", b"", now_ms=-1), ValueError, r"^now_ms: must be >= 0, got -1"),
        (lambda ix: ix.expire(0, -1), ValueError, r"^ttl_ms: must be >= 0, got -1"),
        (lambda ix: ix.expire(-1, 0), ValueError, r"^now_ms: must be >= 0, got -1"),
        (lambda ix: ix.touch("e0", -5), ValueError, r"^now_ms: must be >= 0, got -5"),
        (lambda ix: ix.touch("e0", 1.5), TypeError, r"^now_ms: expected int, got float"),
        (lambda ix: ix.match([1, 2], 5), TypeError, r"^medium: expected str or None, got int"),
        (lambda ix: ix.match_dense([1, 2], b"GPU"), TypeError, r"^medium: expected str or None, got bytes"),
        (lambda ix: ix.store("e0", [4], medium=3), TypeError, r"^medium: expected str or None, got int"),
        (lambda ix: ix.remove("e0", [1], medium=3), TypeError, r"^medium: expected str or None, got int"),
        (lambda ix: ix.blocks_of("e0", 7), TypeError, r"^medium: expected str or None, got int"),
    ],
    ids=["apply-now", "expire-ttl", "expire-now", "touch-now", "touch-float", "match-medium", "match_dense-medium",
         "store-medium", "remove-medium", "blocks_of-medium"],
)
def test_prefix_index_names_the_argument(call, exc, msg):
    ix = _index()
    before = _index_state(ix)
    with pytest.raises(exc, match=msg):
        call(ix)
    assert _index_state(ix) == before


def test_prefix_index_defaults_still_work():
    ix = _index()
    assert ix.match([1, 2, 3]) == {"e0": 3} and ix.match([1, 2, 3], "GPU") == {"e0": 3}
    assert ix.match([1, 2, 3], None) == {"e0": 3}
    assert ix.expire(10, 5) == ["e0"]


@pytest.mark.parametrize("watermark", ["0.1", None, [0.1]])
def test_watermark_of_another_type_is_a_type_error(watermark):
    with pytest.raises(TypeError, match=r"^watermark: a fraction of the blocks"):
        KVCacheManager(16, 16, watermark=watermark)
    assert KVCacheManager(16, 16, watermark=0.5).watermark_blocks == 8


def test_num_blocks_past_the_block_id_range_names_num_blocks():
    with pytest.raises(ValueError, match=r"^num_blocks: 8589934592 exceeds the int32 block-id range"):
        KVCacheManager(num_blocks=2**33, block_size=16)


def test_a_pool_too_large_for_memory_names_the_blocks_asked_for():
    """Under a 6 GiB address-space limit the pool's first allocation fails: the message counts
    the blocks asked for (it said two more: the free queue's two sentinel links)."""
    code = (
        "import resource, kvblock\n"
        "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
        "try:\n"
        "    kvblock.BlockPool(2**31 - 1, True, 16)\n"
        "except MemoryError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("for 2147483647 blocks"), out.stdout



@pytest.mark.parametrize("bad", ["1", b"1", 5.0])
def test_a_block_id_list_of_another_type_says_ints(bad):
    """The message said "expected a sequence of int integers"."""
    from kvblock import BlockPool

    pool = BlockPool(8, True, 16)
    with pytest.raises(TypeError, match=r"^block_ids: expected a sequence of ints, got (str|bytes|float)$"):
        pool.free_ids(bad)
    assert pool.get_num_free_blocks() == 7
