"""The import contract (pyproject.toml, import-linter) holds, and would catch an upward import."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(package_parent: Path, workdir: Path) -> subprocess.CompletedProcess:
    """Run lint-imports with the repository's contracts on the package found under ``package_parent``."""
    shutil.copy(ROOT / "pyproject.toml", workdir / "pyproject.toml")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(package_parent)}
    cmd = [str(LINT_IMPORTS), "--no-cache"]
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_its_layers(tmp_path):
    result = lint_imports(ROOT, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        ("engine/engine.py", "import dynaspec.server.app", ["Layers"]),
        ("spec_decode/proposer.py", "import dynaspec.engine.scheduler", ["Layers"]),
        ("kpolicy/goodput.py", "import torch", ["no torch"]),
        ("kpolicy/cost.py", "import dynaspec.engine.sampler", ["no torch"]),  # torch, one import away
        ("server/app.py", "import ray", ["Ray stays out"]),  # one engine never imports ray
        ("engine/engine.py", "import dynaspec.engine.profiler", ["Layers", "never profiles itself"]),
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path, module, line, broken):
    copy = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "data")
    shutil.copytree(ROOT / "dynaspec", copy / "dynaspec", ignore=skip)
    target = copy / "dynaspec" / module
    target.write_text(target.read_text() + f"\n{line}\n")
    result = lint_imports(copy, tmp_path)
    assert result.returncode != 0
    assert f"{4 - len(broken)} kept, {len(broken)} broken" in result.stdout
    broken_section = result.stdout.split("Broken contracts", 1)[1]
    assert all(name in broken_section for name in broken)
