"""Where a recorded figure came from: the git commit of the checkout that measured it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` when tracked files differ from it); None outside a git checkout."""

    def git(*args: str) -> subprocess.CompletedProcess:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        diff = git("diff", "--quiet", "HEAD", "--")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if diff.returncode == 1 else "")
