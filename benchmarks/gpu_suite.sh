#!/usr/bin/env bash
# The GPU measurements of docs/performance.md, each group in one device call (docs/performance.md gives the exact calls).
#
#   bash benchmarks/gpu_suite.sh run     # full CIFAR-10 FAFI run (batched eager, batched compiled), efficiency at
#                                        # width 1 and 0.25, one profiled round                     (≈ 9 min)
#   bash benchmarks/gpu_suite.sh sweep   # Table 1 throughput: 8 of its 72 runs, --workers $WORKERS   (≤ 9.5 min)
#   bash benchmarks/gpu_suite.sh lease   # one call for a short lease: the full FAFI run (which is also the
#                                        # table's clean seed-1 FAFI point), efficiency at width 1 and 0.25, then
#                                        # the α = 0.05 table (configs/sweeps/alpha005-full*.yaml) until $DEADLINE
#                                        # seconds, then torch.compile for 5 rounds if time is left  (= $DEADLINE)
#     FULL_ROUNDS=N: the batched run checks N rounds instead of being the table's point (0: none); TABLE_ENGINE=sequential
#     trains the table client by client whatever the checks showed; TABLE_WORKERS=k runs k table points at once;
#     RESUME=results/gpu-lease/gpu-lease/callN/table carries that call's finished runs into the table
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

stage() {  # stage NAME SECONDS CMD...: run CMD under a time limit, its whole output into the log; returns its rc
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
  local t0=$SECONDS rc
  timeout "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "== $name: rc $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  return $rc
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
  lease)
    DEADLINE=${DEADLINE:-560}  # seconds from the start by which everything is packed into $OUT
    EXTRA=(${EXTRA:-})          # KEY=VALUE over every run (a CPU rehearsal shrinks the runs with it)
    TABLE=${TABLE:-/tmp/table}
    # Every 15 s the records of every run so far (never checkpoints) go into $OUT/records.tar.gz, so a call cut
    # short still brings back each finished run.
    pack() {  # what this call ran (a run copied in by RESUME is not its record)
      (cd "$TABLE" 2>/dev/null && find . \( -name config.yaml -o -name partition.json -o -name metrics.jsonl \
        -o -name fuse.jsonl -o -name summary.md -o -name sweep_point.json -o -name sweep.json -o -name sweep.md \
        -o -name state.json \) -print0 | grep -z -v -F -f <(cat .resumed 2>/dev/null; echo ./.none/) \
        | tar --null -czf "$OUT/records.tmp" -T - && mv "$OUT/records.tmp" "$OUT/records.tar.gz")
    }
    # RESUME=DIR: a committed call's table (results/gpu-lease/gpu-lease/callN/table); its finished runs are
    # copied in, so that each sweep reports them finished and goes on with the points they lack.
    for d in ${RESUME:+$RESUME/*/*}; do
      if grep -q '"status": "finished"' "$d/state.json" 2>/dev/null; then
        sweep=$(basename "$(dirname "$d")"); mkdir -p "$TABLE/$sweep" && cp -r "$d" "$TABLE/$sweep/"
        echo "./$sweep/$(basename "$d")/" >>"$TABLE/.resumed"; echo "resumed: $sweep/$(basename "$d")" >>"$LOG"
      fi
    done
    ( while sleep 15; do pack; done ) & packer=$!
    python3 - >>"$LOG" 2>&1 <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
from profile_round import conv_dtype_under_vmap
if torch.cuda.is_available():
    dtype = conv_dtype_under_vmap(torch.device("cuda"), torch.bfloat16)
    print("a convolution under vmap + autocast(bf16) computes in", dtype)
PY
    point="$TABLE/alpha005-full/fafi_protocol=clean_seed=1"
    short=()
    if [ -n "${FULL_ROUNDS:-}" ]; then  # FULL_ROUNDS=N: the batched run is a check of N rounds, not a table point
      point=/tmp/full-check; short=("rounds=$FULL_ROUNDS")
    fi
    rc_full=1
    if [ "${FULL_ROUNDS:-}" != 0 ]; then  # FULL_ROUNDS=0: no batched run at all
      stage full-batched "${FULL_LIMIT:-200}" python3 "${FULL[@]}" --out "$point" client_engine=batched \
        "${EXTRA[@]}" "${short[@]}"
      rc_full=$?
    fi
    cp "$point/metrics.jsonl" "$OUT/full-batched-metrics.jsonl" 2>/dev/null
    engine=batched
    if [ "$rc_full" != 0 ] || [ -n "${FULL_ROUNDS:-}" ]; then  # failed, cut, or a check: the table runs client by client
      engine=sequential; rm -rf "$point"
    fi
    if [ "${EFFICIENCY:-1}" = 1 ]; then  # EFFICIENCY=0: measured in an earlier call
      stage efficiency-w1 60 python3 benchmarks/efficiency.py model.width=1 --clients 5 --repeats 2 "${EXTRA[@]}"
      stage efficiency-w025 45 python3 benchmarks/efficiency.py model.width=0.25 --clients 5 --repeats 2 "${EXTRA[@]}"
    fi
    # The table trains with the engine that ran faster end to end in the first efficiency stage (width 1:
    # "÷ sequential end to end"); a batched full run that lost stays beside the sweep as a measurement.
    ratio=$(sed -n 's/.*sequential end to end: \([0-9.]*\)).*/\1/p' "$LOG" | head -1)
    if [ "$engine" = batched ] && [ -n "$ratio" ] && awk -v r="$ratio" 'BEGIN { exit !(r < 1) }'; then
      engine=sequential; mkdir -p "$TABLE/full-run" && mv "$point" "$TABLE/full-run/fafi_protocol=clean_seed=1_batched"
    fi
    wall=$(sed -n 's/^wall \([0-9.]*\) s.*/\1/p' "$LOG" | head -1)
    [ "$engine" = batched ] || wall=""
    # Concurrent runs share the GPU: more of them finish in all, but each takes longer, and a run cut off by the
    # deadline brings back nothing. So as many at once as still finish in the time left: one run alone takes the
    # full run's wall (or, training client by client, ~280 s: per-client training alone on an H200), and k runs
    # sharing a GPU take about 1 + 0.42 (k - 1) times as long each (three on an H100: 10.1 s per round each; one
    # alone on an H200: 5.4 s).
    left=$((DEADLINE - SECONDS - 20))
    workers=$(awk -v t="${wall:-280}" -v left="$left" \
      'BEGIN { w = 1; for (k = 2; k <= 3; k++) if (t * (1 + 0.42 * (k - 1)) <= left) w = k; print w }')
    workers=${TABLE_WORKERS:-$workers}; engine=${TABLE_ENGINE:-$engine}
    for sweep in alpha005-full alpha005-full-baselines; do
      left=$((DEADLINE - SECONDS - 20))
      [ "$left" -gt 30 ] || break
      stage "table-$sweep" "$left" python3 -m flare.cli sweep --config "configs/sweeps/$sweep.yaml" \
        --out "$TABLE/$sweep" --workers "$workers" --no-report --quiet "dataset.root=$DATA" \
        "client_engine=$engine" "${EXTRA[@]}"
      cat "$TABLE/$sweep/sweep.md" >>"$LOG" 2>/dev/null
    done
    left=$((DEADLINE - SECONDS - 15))
    if [ "$left" -gt 60 ]; then
      stage full-compiled-5-rounds "$left" python3 "${FULL[@]}" --out /tmp/full-compiled client_engine=batched \
        compile=true rounds=5 "${EXTRA[@]}"
    fi
    kill "$packer" 2>/dev/null; pack
    ;;
  *) echo "usage: $0 run|sweep|lease" >&2; exit 2 ;;
esac
