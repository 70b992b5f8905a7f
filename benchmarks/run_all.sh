#!/usr/bin/env bash
# Every benchmark in one go, for RESULTS.md: machine facts, the kernel grid,
# benchmark (b) at the CPU-sized and at accelerator-sized kernel calls, the
# side-by-side sweep benchmark, the issue order's effect, and the README's main job. Logs go to
# $OUT (default: benchmarks/out). Run from the repository root, with the
# package importable (pip install -e . or PYTHONPATH=.).
set -uo pipefail
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {  # name, command...
  local name=$1
  shift
  echo "=== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$out/$name.txt"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
{ date -u; git rev-parse --short HEAD 2>/dev/null; uname -a; nproc; nvidia-smi -L 2>/dev/null; } | tee "$out/machine.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'backend', jax.default_backend(), jax.devices())" | tee -a "$out/machine.txt"
run kernel python3 benchmarks/kernel.py
run gpt3_large_calls python3 benchmarks/sweep_gpt3.py --groups-per-call 256 --rows-per-group 16
run sweep python3 benchmarks/sweep.py
run issue_order python3 benchmarks/issue_order.py
run main_job python3 -m distir_jax.cli sweep --output "$out/sweep.csv"
