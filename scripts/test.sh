#!/usr/bin/env bash
# The project's test job: sets up the virtual environment, then lint and the test suite.
# The README's test command and .ci/run both run exactly this script.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
.venv/bin/ruff check kvaudit tests bench examples scripts
.venv/bin/ruff format --check kvaudit tests bench examples scripts
.venv/bin/python -m pytest -q
