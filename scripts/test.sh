#!/usr/bin/env bash
# Sets up everything the tests need, then lints (ruff), type-checks core/, policies/, simulator/,
# reports/, traces/, fidelity/, routers/, spec_decode/, planner/ and the engine's orchestration,
# gpu/engine/ (mypy), and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY="${PYTHON:-python3}"
bash scripts/setup.sh --test
"$PY" -m ruff check .
# The package is the repository root itself: mypy finds `twinserve.*` through a folder that
# holds a link named twinserve to it.
TYPES=$(mktemp -d)
trap 'rm -rf "$TYPES"' EXIT
ln -s "$ROOT" "$TYPES/twinserve"
(cd "$TYPES" && "$PY" -m mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$TYPES/.cache" \
    -p twinserve.core -p twinserve.policies -p twinserve.simulator -p twinserve.reports \
    -p twinserve.traces -p twinserve.gpu.engine -p twinserve.fidelity -p twinserve.routers \
    -p twinserve.spec_decode -p twinserve.planner)
"$PY" -m pytest -q "$@"
