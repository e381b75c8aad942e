"""The README's runnable parts, for tests/packaging/test_readme.py: its ```bash and ```python blocks,
their commands, and the skip markers (`<!-- readme-test: skip: WHY -->` on the line before a block)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from tests.packaging.pkgkit import REPO

README = REPO / "README.md"
_BLOCK = re.compile(r"(?:<!-- readme-test: skip: (?P<skip>[^\n]*?) -->\n)?^```(?P<lang>bash|python)\n(?P<body>.*?)^```",
                    re.S | re.M)
# The one rewrite: a fixed router port would collide with whatever else runs on the machine (a
# developer's own mesh, another test), so `tokenrelay up` without --port gets --port 0.
_UP = "tokenrelay up"


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    skip: str          # why it is not run ("" = it is run)
    line: int          # where it starts in the README

    @property
    def name(self) -> str:
        first = next((c for c in self.commands()), self.body.strip().splitlines()[0])
        return f"README.md:{self.line}: {first}"

    def commands(self) -> list[str]:
        """Shell commands of a bash block: continuation lines joined, comment and blank lines dropped,
        `A && B` split in two (so each part can get its own environment)."""
        if self.lang != "bash":
            return []
        logical = re.sub(r"\\\n\s*", " ", self.body)
        out: list[str] = []
        for line in logical.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in line.split(" && "))
        return out


def blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m["lang"], m["body"], (m["skip"] or "").strip(), text.count("\n", 0, m.start("lang")) + 1)
            for m in _BLOCK.finditer(text)]


def is_up(command: str) -> bool:
    return command.startswith(_UP + " ") or command == _UP


def rewritten(command: str, bench_duration: str) -> str:
    """The command as the test runs it: `tokenrelay up` on an ephemeral port unless one is given, and a
    bench's `--duration` shortened (the README's 30 s twice over, with --compare, would dominate CI)."""
    words = shlex.split(command, comments=True)
    if is_up(command) and "--port" not in words:
        command = command.replace(_UP, f"{_UP} --port 0", 1)
    if command.startswith("tokenrelay bench ") and "--duration" in words:
        command = re.sub(r"--duration \S+", f"--duration {bench_duration}", command)
    return command
