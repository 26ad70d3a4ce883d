"""``kvblock._core.RequestBlockHasher`` called through CPython's vectorcall protocol
(``rust/src/py/fast/hasher_call.rs``): vLLM's ``Request`` calls its hasher on every appended
token. After an instance's first call (through ``tp_call``) its later calls take the vectorcall
entry; every call shape must give what the first call gives, or raise what it raises, and a
no-op call (no new full block) a new empty list each time."""

from __future__ import annotations

import array

import pytest

from kvblock import _core
from kvblock import hashing as H
from kvblock.request import Request as KvRequest


class DictRequest:
    """A request type whose fields live in its instance ``__dict__``, as vLLM's ``Request``'s."""

    def __init__(self, tokens, block_hashes=None):
        self._all_token_ids = tokens
        self.block_hashes = [] if block_hashes is None else block_hashes
        self.lora_request = None
        self.mm_features = []
        self.cache_salt = None
        self.prompt_embeds = None


def _outcome(fn, *args, **kwargs):
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:  # the same exception type and message on both paths
        return "raised", type(e), str(e)


def _hasher(block_size=4, lookahead=0):
    h = H.get_request_block_hasher(block_size, H.sha256, lookahead)
    assert isinstance(h, _core.RequestBlockHasher)
    return h


def test_every_call_shape_answers_as_the_first_call():
    h = _hasher()
    first = _outcome(h, DictRequest(list(range(10))))  # through tp_call: switches the instance
    assert first[0] == "ok" and len(first[1]) == 2
    req = DictRequest(list(range(10)))
    assert _outcome(h, req) == first
    assert _outcome(h, request=DictRequest(list(range(10)))) == first
    for args, kwargs in [((), {}), ((req, req), {}), ((), {"nope": req}), ((req,), {"request": req})]:
        fresh = _hasher()
        slow = _outcome(fresh, *args, **kwargs)  # a fresh instance's first call: tp_call
        fresh(DictRequest([]))
        assert _outcome(h, *args, **kwargs) == slow == _outcome(fresh, *args, **kwargs), (args, kwargs)
        assert slow[:2] == ("raised", TypeError)


def test_no_new_block_gives_a_new_empty_list_each_time():
    h = _hasher()
    req = DictRequest(list(range(8)))
    req.block_hashes.extend(h(req))
    assert len(req.block_hashes) == 2
    for _ in range(3):
        req._all_token_ids.append(7)
        a, b = h(req), h(req)
        assert a == [] and b == [] and a is not b
    req._all_token_ids.append(7)  # the third block is full now
    assert len(h(req)) == 1


@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize("tokens", [list, lambda t: array.array("i", t)])
def test_decode_calls_hash_what_a_fresh_hasher_hashes(tokens, lookahead):
    """Token by token (the no-op check on lists and on sized buffers, with lookahead), the
    hashes are those of one call on the whole sequence."""
    h = _hasher(4, lookahead)
    h(DictRequest([]))
    req = DictRequest(tokens(range(3)))
    for t in range(3, 40):
        req.block_hashes.extend(h(req))
        req._all_token_ids.append(t)
    req.block_hashes.extend(h(req))
    whole = DictRequest(tokens(range(40)))
    assert req.block_hashes == _hasher(4, lookahead)(whole)
    assert len(req.block_hashes) == (40 - lookahead) // 4


def test_bad_requests_raise_the_same_on_both_paths():
    for bad in [DictRequest((1, 2, 3, 4, 5), block_hashes=()), DictRequest(None), object(), None]:
        fresh = _hasher()
        slow = _outcome(fresh, bad)  # through tp_call
        fresh(DictRequest([]))
        assert slow[0] == "raised"
        assert _outcome(fresh, bad) == slow, bad


def test_kvblock_requests_hash_alike():
    h = _hasher(16)
    a = KvRequest("a", list(range(40)), block_hasher=h)
    for t in range(40, 80):
        a.append_output_token_ids(t)
    b = KvRequest("b", list(range(80)), block_hasher=_hasher(16))
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 5
