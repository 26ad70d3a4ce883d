"""Token ids are checked where they enter a request (issue 13): a bad one used to be kept
while no block completed, and the request could then never grow (every later append raised
from the hasher, which meets the bad token again)."""

from __future__ import annotations

import numpy as np
import pytest

from kvblock import KVCacheManager, Request
from kvblock.reference.manager import KVCacheManager as RefManager

BAD = [[None], [1.0], [True], [1, 2, None], None, 2.5, False, "12", b"\x01", [np.float32(3)], object()]


@pytest.fixture(params=["kvblock", "reference"])
def hasher(request):
    mgr = (KVCacheManager if request.param == "kvblock" else RefManager)(64, 4)
    return mgr.request_block_hasher


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_output_tokens_are_refused_before_any_is_appended(hasher, bad):
    req = Request("a", [1, 2, 3, 4, 5], block_hasher=hasher)  # 1 full block, 1 token in the next
    before = (list(req.all_token_ids), list(req.output_token_ids), list(req.block_hashes))
    with pytest.raises(TypeError, match="token_ids"):
        req.append_output_token_ids(bad)  # would complete no block
    assert (req.all_token_ids, req.output_token_ids, req.block_hashes) == before
    # the request still grows, and its hashes are those of the good tokens only
    req.append_output_token_ids([6, 7, 8])
    ref = Request("b", [1, 2, 3, 4, 5, 6, 7, 8], block_hasher=hasher)
    assert req.block_hashes == ref.block_hashes and len(req.block_hashes) == 2


def test_the_bad_token_is_named(hasher):
    req = Request("a", [1], block_hasher=hasher)
    with pytest.raises(TypeError, match=r"token_ids\[2\]: a token id must be int, got NoneType"):
        req.append_output_token_ids([5, 6, None])
    with pytest.raises(TypeError, match=r"token_ids: expected an int or a sequence of ints, got float"):
        req.append_output_token_ids(1.5)
    assert req.num_tokens == 1


@pytest.mark.parametrize("bad", [[1, None], [True, 2], [0.0]], ids=repr)
def test_bad_prompt_tokens_are_refused_without_a_hasher(bad):
    """A prompt shorter than a block is never hashed by the constructor: it is checked all
    the same (with or without a hasher)."""
    with pytest.raises(TypeError, match=r"prompt_token_ids\[\d\]"):
        Request("a", bad)
    with pytest.raises(TypeError, match=r"prompt_token_ids\[\d\]"):
        Request("a", bad, block_hasher=KVCacheManager(8, 16).request_block_hasher)


def test_integer_likes_are_token_ids(hasher):
    """numpy integers (one, or in a list) and ints beyond 64 bits are token ids. kvblock's
    hasher hashes a numpy integer as the int it holds; the reference, like vLLM, pickles the
    numpy object (README: Hashing)."""
    req = Request("a", [np.int64(1), 2, 3], block_hasher=hasher)
    req.append_output_token_ids(np.int32(4))
    req.append_output_token_ids([2**70, np.uint64(6)])
    assert req.num_tokens == 6 and len(req.block_hashes) == 1
    if isinstance(hasher, type(KVCacheManager(8, 4).request_block_hasher)):
        plain = Request("b", [1, 2, 3, 4, 2**70, 6], block_hasher=hasher)
        assert req.block_hashes == plain.block_hashes


def test_arrays_are_their_tokens(hasher):
    """A sampler's output as a numpy array (or a 0-d one) appends its tokens, not the array
    as one token (numpy arrays define ``__index__``, which once took them for a scalar and
    left the request unable to hash its next block)."""
    req = Request("a", [1, 2, 3], block_hasher=hasher)
    req.append_output_token_ids(np.array([4, 5], dtype=np.int64))
    req.append_output_token_ids(np.array(6, dtype=np.int32))
    req.append_output_token_ids(np.arange(7, 9, dtype=np.uint16))
    assert req.output_token_ids == [4, 5, 6, 7, 8] and req.num_tokens == 8
    assert all(type(t) is int for t in req.all_token_ids)
    plain = Request("b", [1, 2, 3, 4, 5, 6, 7, 8], block_hasher=hasher)
    assert req.block_hashes == plain.block_hashes and len(req.block_hashes) == 2


@pytest.mark.parametrize(
    "bad",
    [np.arange(3, dtype=np.float32), np.array([True, False]), np.array(["1"]), np.zeros((2, 2), dtype=np.int64),
     np.float64(1.0), np.bool_(True)],
    ids=repr,
)
def test_arrays_of_non_token_ids_are_refused(hasher, bad):
    req = Request("a", [1, 2, 3, 4, 5], block_hasher=hasher)
    before = (list(req.all_token_ids), list(req.output_token_ids), list(req.block_hashes))
    with pytest.raises(TypeError, match=r"token_ids\[0\]"):
        req.append_output_token_ids(bad)
    assert (req.all_token_ids, req.output_token_ids, req.block_hashes) == before
    req.append_output_token_ids(np.array([6, 7, 8]))
    assert len(req.block_hashes) == 2


def test_torch_tensors_are_their_tokens(hasher):
    torch = pytest.importorskip("torch")
    req = Request("a", [1, 2, 3], block_hasher=hasher)
    req.append_output_token_ids(torch.tensor([4, 5]))
    req.append_output_token_ids(torch.tensor(6))
    assert req.output_token_ids == [4, 5, 6]
    with pytest.raises(TypeError, match=r"token_ids\[0\]"):
        req.append_output_token_ids(torch.tensor([7.0]))
    assert req.num_tokens == 6
