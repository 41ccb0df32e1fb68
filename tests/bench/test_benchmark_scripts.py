"""Every script under benchmarks/ answers --help quickly without loading a model, and the index
(benchmarks/README.md) names every one of them."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(
    p for ext in ("py", "sh") for p in BENCHMARKS.rglob(f"*.{ext}") if "__pycache__" not in p.parts
)
TIMEOUT_S = 300

# Runs every Python script's --help in one interpreter (torch imported once, not once per script):
# argv[1:] are the scripts; prints {script: [exit code, stdout]} as JSON.
_DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    buf, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code, buf = 1, io.StringIO(f"{type(e).__name__}: {e}")
    out[path] = [code, buf.getvalue()]
sys.stdout.write(json.dumps(out))
"""


@cache
def _help_outputs() -> dict[Path, tuple[int, str]]:
    """Each script's --help: exit code and what it printed."""
    scripts = [str(s) for s in SCRIPTS if s.suffix == ".py"]
    run = subprocess.run(
        [sys.executable, "-c", _DRIVER, *scripts], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = {Path(k): (code, text) for k, (code, text) in json.loads(run.stdout).items()}
    for script in SCRIPTS:
        if script.suffix == ".sh":
            sh = subprocess.run(
                ["bash", str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
            )
            out[script] = (sh.returncode, sh.stdout)
    return out


def _id(script: Path) -> str:
    return script.relative_to(BENCHMARKS).as_posix()


@pytest.mark.parametrize("script", SCRIPTS, ids=_id)
def test_help_exits_zero_with_text(script: Path) -> None:
    code, text = _help_outputs()[script]
    assert code == 0, text[-2000:]
    assert text.strip(), "--help printed nothing"


def test_scripts_found() -> None:
    assert len(SCRIPTS) > 10


def test_index_names_every_script() -> None:
    index = (BENCHMARKS / "README.md").read_text()
    missing = [_id(s) for s in SCRIPTS if s.name not in index]
    assert not missing, f"benchmarks/README.md does not mention {missing}"
