#!/usr/bin/env bash
# The GPU measurements of docs/performance.md, each group in one device call (docs/performance.md gives the exact calls).
#
#   bash benchmarks/gpu_suite.sh run     # full CIFAR-10 FAFI run (batched eager, batched compiled), efficiency at
#                                        # width 1 and 0.25, one profiled round                     (≈ 9 min)
#   bash benchmarks/gpu_suite.sh sweep   # Table 1 throughput: 8 of its 72 runs, --workers $WORKERS   (≤ 9.5 min)
#
# Expects the CIFAR-10 export in .carry/ and the packages the GPU image lacks as wheels in .whl/ (both ignored by
# git; docs/performance.md says how to fill them). Everything it prints goes to $OUT/suite.log; the run's
# metrics, the profile's trace and the sweep's table come back beside it.
set -uo pipefail
what=${1:-run}
OUT=${OUT:-runs/gpu-suite}
DATA=${DATA:-.carry/cifar10-jpg.tar.gz}
WORKERS=${WORKERS:-3}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$OUT/suite.log"

stage() {  # stage NAME SECONDS CMD...: run CMD under a time limit, its whole output into the log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "== $name: rc $? after $((SECONDS - t0)) s" | tee -a "$LOG"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, kornia; print('torch', torch.__version__, 'kornia', kornia.__version__)"; } >>"$LOG" 2>&1
FULL=(benchmarks/full_run.py cifar10 --root "$DATA")
case "$what" in
  run)
    stage full-batched 170 python3 "${FULL[@]}" --out /tmp/full-batched client_engine=batched
    cp /tmp/full-batched/metrics.jsonl "$OUT/full-batched-metrics.jsonl" 2>/dev/null
    stage full-batched-compiled 190 python3 "${FULL[@]}" --out /tmp/full-compiled client_engine=batched compile=true
    cp /tmp/full-compiled/metrics.jsonl "$OUT/full-compiled-metrics.jsonl" 2>/dev/null
    stage efficiency-w1 75 python3 benchmarks/efficiency.py model.width=1 --clients 5 --repeats 2
    stage efficiency-w025 60 python3 benchmarks/efficiency.py model.width=0.25 --clients 5 --repeats 2
    stage profile 45 python3 benchmarks/profile_round.py --preset fafi --out /tmp/profile dataset.name=cifar10 \
      dataset.format=imagefolder "dataset.root=$DATA" model.name=resnet18 num_clients=5 partition.alpha=0.05 \
      client_engine=batched
    gzip -c /tmp/profile/trace.json >"$OUT/trace.json.gz" 2>/dev/null
    ;;
  sweep)
    stage sweep-sample 560 python3 -m flare.cli sweep --config configs/sweeps/table1-sample.yaml \
      --workers "$WORKERS" --out /tmp/sweep --no-report --quiet "dataset.root=$DATA"
    cp /tmp/sweep/sweep.md "$OUT/sweep.md" 2>/dev/null && cat /tmp/sweep/sweep.md >>"$LOG"
    ;;
  *) echo "usage: $0 run|sweep" >&2; exit 2 ;;
esac
