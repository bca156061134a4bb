#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py, docs/benchmarks.md): our training step, FSDP2 and DCP
# checkpoints against plain PyTorch on one GPU, no Ray, no MLflow, no network, in at most 6
# minutes; one JSON file. It runs on the lent GPU machine as it is: its python3 has a CUDA
# torch; pydantic and what it needs come from `.whl/` (made here by `make gpu-wheels`, carried
# with the tree), installed into a scratch folder, never into that Python.
#
#   benchmarks/gpu_check.sh [--dry-run] [--out gpu_check.json] [--parts a,b,c,d,e]
#                            [--nproc-per-node N]
#
# One process for one GPU; `--nproc-per-node N` (N GPUs, or `gpu`: all visible) starts N under
# torchrun on this machine, one per GPU: (d)'s hsdp mesh is then 2 replicas x N/2 shards, and
# (e) splits each block over tensor-parallel pairs (skipped, saying why, on one GPU).
#
# Python: $PYTHON, else this checkout's .venv (make install), else python3.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import pydantic" 2>/dev/null; then
  if ! ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: $PYTHON has no pydantic and there is no .whl/ folder: run 'make gpu-wheels' where pip can download, and bring .whl/ along" >&2
    exit 2
  fi
  SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$ROOT"/.whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# raytrain_lm from this tree (it is not installed there); the benchmarks' own helpers beside it.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
NPROC=1
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc-per-node) NPROC="${2:?--nproc-per-node takes a number}"; shift 2 ;;
    --nproc-per-node=*) NPROC="${1#*=}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ "$NPROC" = 1 ]; then
  exec "$PYTHON" "$ROOT/benchmarks/gpu_check.py" ${ARGS[@]+"${ARGS[@]}"}
fi
# torchrun's rendezvous on this machine only (no network); each process finds its GPU by rank.
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  "$ROOT/benchmarks/gpu_check.py" ${ARGS[@]+"${ARGS[@]}"}
