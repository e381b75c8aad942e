"""The flags `tokenrelay up` gives its tokenizer replicas (tokenrelay_tools/cli/launcher.py)."""

from __future__ import annotations

import pathlib

from tokenizer_svc.config import load_settings
from tokenrelay_tools.cli.launcher import tokenizer_argv

MODEL = pathlib.Path("/models/m")


def test_one_replica_keeps_the_whole_library_pool() -> None:
    assert tokenizer_argv(MODEL, 1, [], cores=16) == ["--tokenizer", "/models/m"]


def test_replicas_share_the_cores_and_user_flags_win() -> None:
    assert tokenizer_argv(MODEL, 4, [], cores=16) == ["--tokenizer", "/models/m", "--library-threads", "4"]
    assert tokenizer_argv(MODEL, 3, [], cores=2)[-1] == "1"          # never below one thread
    argv = tokenizer_argv(MODEL, 2, ["--library-threads=6", "--chat-template=chatml"], cores=8)
    assert load_settings(argv).library_threads == 6                   # the user's flag comes last
