#!/usr/bin/env bash
# The GPU check (docs/benchmarks.md): on a machine with one GPU, in at most 8 minutes and with
# nothing from outside, it measures our loop against a plain one, a sharded Llama and the
# demo end to end, and writes one JSON file. `--dry-run` runs the same code on CPU, toy size.
#
#   benchmarks/gpu_check.sh [--dry-run] [--out gpu_check.json]
#
# It uses the repository's environment (`make install`), or the Python in $PYTHON.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
exec "$PYTHON" "$ROOT/benchmarks/gpu_check.py" "$@"
