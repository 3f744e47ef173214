"""Run an IR test file's `// RUN:` lines as lit does, for the pytest collector in conftest.py.

A RUN line may continue on the next RUN line after a trailing `\\`. `%s` is the file, `%S`
its folder, `%t` a scratch path, `%%` a percent sign. Lines run in bash with pipefail, with the
console scripts next to this Python (`fxsched`, `filecheck`) first on PATH, and `not` (as lit's)
inverting a command's status.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

_RUN = re.compile(r"//\s*RUN:\s?(.*)$")


def run_lines(text: str) -> list[str]:
    """The commands of the file's RUN lines, continuations joined."""
    commands, pending = [], ""
    for line in text.splitlines():
        m = _RUN.search(line)
        if not m:
            continue
        part = m.group(1).rstrip()
        if part.endswith("\\"):
            pending += part[:-1] + " "
            continue
        commands.append(pending + part)
        pending = ""
    if pending:
        commands.append(pending)
    return commands


def substitute(command: str, path: str, scratch: str) -> str:
    table = {"%s": path, "%S": os.path.dirname(path), "%t": scratch, "%%": "%"}
    return re.sub(r"%[sSt%]", lambda m: table[m.group()], command)


class RunFailure(Exception):
    """A RUN line failed: the command, its status and what it printed."""


def run_file(path: str) -> int:
    """Run every RUN line of `path`; raise RunFailure at the first that fails. Returns how many ran."""
    path = os.path.abspath(path)
    with open(path) as f:
        commands = run_lines(f.read())
    if not commands:
        raise RunFailure(f"{path}: no RUN lines")
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        for command in commands:
            line = substitute(command, path, os.path.join(tmp, "t"))
            result = subprocess.run(["bash", "-o", "pipefail", "-c", 'not() { ! "$@"; }\n' + line],
                                    capture_output=True, text=True, env=env, cwd=tmp)
            if result.returncode != 0:
                raise RunFailure(f"RUN: {command}\n$ {line}\nexit status {result.returncode}\n"
                                 f"{result.stdout}{result.stderr}")
    return len(commands)
