#!/usr/bin/env bash
# Set up (idempotent), lint (ruff, the import-layer contract), then run the whole test suite, the
# tests on the real offline packs included.
# pytest's exit code 5 ("no tests collected") is a failure here, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/ruff check dynaspec tests benchmarks || exit 1
.venv/bin/ruff format --check dynaspec tests benchmarks || exit 1
.venv/bin/lint-imports || exit 1
.venv/bin/python -m pytest -q -rs --durations=25 "$@"  # the slowest tests, to keep the suite in budget
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
