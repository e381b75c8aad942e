"""The `tokenrelay` CLI's argument checks: a bad value is one line naming the flag and exit status 2
(a negative --max-tokens was a Python traceback), and prompts come from argv, stdin or a file."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tests.data import REPO
from tokenrelay_tools.cli.main import _parser


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--max-tokens", "-5"], "--max-tokens"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "hi", "--max-tokens", "many"], "--max-tokens"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "hi", "--top-k", "-1"], "--top-k"),
    (["generate", "hi", "--seed", "-1"], "--seed"),
    (["generate", "hi", "--timeout", "0"], "--timeout"),
    (["chat", "--max-tokens", "-5"], "--max-tokens"),
])
def test_a_bad_value_is_one_line_and_status_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "Traceback" not in err


def test_the_installed_command_says_it_in_one_line():
    out = subprocess.run([sys.executable, "-m", "tokenrelay_tools.cli.main", "generate", "hi", "--max-tokens", "-5"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "tokenrelay generate: error: argument --max-tokens: must be between 1 and 1048576, got -5"]


def test_prompt_from_a_file_from_stdin_and_a_missing_file(tmp_path, monkeypatch, capsys):
    long_prompt = "word " * 50_000   # longer than an argv entry comfortably carries
    path = tmp_path / "prompt.txt"
    path.write_text(long_prompt, encoding="utf-8")
    assert _parser().parse_args(["generate", f"@{path}"]).prompt == long_prompt
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    assert _parser().parse_args(["generate", "-"]).prompt == "from stdin"
    assert _parser().parse_args(["generate", "plain text"]).prompt == "plain text"
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["generate", f"@{tmp_path / 'missing.txt'}"])
    assert exit_info.value.code == 2
    assert "cannot read the prompt file" in capsys.readouterr().err


def test_good_values_pass_through():
    args = _parser().parse_args(["generate", "hi", "--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9",
                                 "--top-k", "40", "--seed", "18446744073709551615", "--timeout", "2.5"])
    assert (args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed, args.timeout) == \
        (7, 0.5, 0.9, 40, (1 << 64) - 1, 2.5)
