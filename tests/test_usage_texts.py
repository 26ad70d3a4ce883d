"""Errors and help name what the user passed (issue 34, item 7): ``KVCacheManager`` names
``num_blocks`` (not the pool's ``num_gpu_blocks``) and every ``kvblock demo`` option has a
help text with its default."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cli_helpers import run_cli
from kvblock import KVCacheManager
from kvblock.worker.demo_args import build_parser


@pytest.mark.parametrize("n", [0, -3])
def test_num_blocks_error_names_num_blocks(n):
    with pytest.raises(ValueError, match=rf"^num_blocks: must be > 0 .*got {n}$"):
        KVCacheManager(num_blocks=n, block_size=16)


@pytest.mark.parametrize("n", [2.0, "8", True])
def test_num_blocks_must_be_an_int(n):
    with pytest.raises(TypeError, match="^num_blocks: must be an int"):
        KVCacheManager(num_blocks=n, block_size=16)


def test_numpy_int_num_blocks_still_works():
    assert KVCacheManager(num_blocks=np.int64(5), block_size=16).block_pool.get_num_free_blocks() == 4


def test_demo_help_documents_every_option():
    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, action.option_strings
        if action.default not in (None, False):
            assert re.search(rf"default {re.escape(str(action.default))}\b", action.help), action.option_strings


@pytest.mark.parametrize("option,value,policy", [("--ttl-s", "5", "ttl"), ("--pin-tokens", "64", "pin-system-prompts")])
def test_a_policy_setting_without_its_policy_is_named_as_ignored(capsys, option, value, policy):
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "5", option, value, "--no-progress")
    assert code == 0 and f"{option} is a setting of --retention {policy}" in err and "ignored" in err
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "5", option, value, "--retention", policy,
                             "--no-progress")
    assert code == 0 and "ignored" not in err
