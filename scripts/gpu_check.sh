#!/usr/bin/env bash
# Check recscale on a CUDA machine in one command: install the project (nothing else:
# torch and triton must already be there, as on the GPU images), run `recscale bench
# throughput` for configs A and B (batch 2048 and 16384, TF32, and bf16 at 16384) and
# for the two published model shapes the forecast is checked against (DeepLearningExamples'
# DLRM at batch 65536, MLPerf's DLRM-DCNv2 at 6912 a GPU; tables capped at 4 GB), a
# kernel-by-kernel profile of the first in TF32, where config A's step waits on the GPU,
# the host ops each stage of A's and B's steps dispatches,
# then the whole test suite on the GPU,
# and print one summary table with each run's stages.
#
#   bash scripts/gpu_check.sh                 # OUT=gpu_check/ gets the logs and JSON
#   BUDGET_S=480 bash scripts/gpu_check.sh    # the tests stop so that all ends in 480 s
#   RESUME=done.log BENCH=0 bash scripts/gpu_check.sh   # the tests an earlier run left
#
# Benchmarks come first: they are short and bounded (90 s each); the suite takes the
# rest, on WORKERS processes (default 8) where pytest-xdist is installed. The test files
# that run device code go first and those that never touch a device (CLI argument
# checks, hostile files, import layers, the forecast's arithmetic) last, so a budget that
# cuts the suite short cuts those. RESUME names an earlier run's tests.log (copied into
# the tree, so that it travels to the GPU machine): the tests it saw pass or skip are
# deselected, the failed ones run again. BENCH=0 skips the benchmarks and profiles.
# Exit code: the test suite's (the benchmarks report, they do not fail the check).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check}
BUDGET_S=${BUDGET_S:-0}
WORKERS=${WORKERS:-8}
START=$(date +%s)
mkdir -p "$OUT"

"$PY" - <<'PYEOF' || { echo "gpu_check: no CUDA device visible to torch" >&2; exit 2; }
import sys, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}")
sys.exit(0 if torch.cuda.is_available() else 1)
PYEOF
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    >"$OUT/nvidia-smi.csv" 2>&1 || true
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "gpu_check: install failed, see $OUT/install.log" >&2; exit 2; }

bench() {  # name, then recscale bench throughput arguments
    local name=$1
    shift
    echo "-- $name"
    timeout 90 "$PY" -m recscale bench throughput --steps 50 --json --train.device=cuda "$@" \
        >"$OUT/bench-$name.json" 2>"$OUT/bench-$name.log" \
        || echo "   failed: see $OUT/bench-$name.log"
}

BENCH=${BENCH:-1}
RESUME=${RESUME:-}
if [ "$BENCH" != 0 ]; then
echo "== bench throughput =="
for cfg in A B; do
    bench "$cfg-2048-tf32" --config "$cfg" --train.batch_size=2048 --train.precision=tf32
    for prec in tf32 bf16; do
        bench "$cfg-16384-$prec" --config "$cfg" --train.batch_size=16384 --train.precision="$prec"
    done
done
tables=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks')
from forecast_validation import capped; print(capped(4)[0])")
for prec in tf32 bf16; do
    bench "dle-65536-$prec" --config criteo_terabyte "$tables" --train.batch_size=65536 \
        --optimizer.name=sgd --embedding.optimizer=sgd --train.precision="$prec"
    bench "dcnv2-6912-$prec" --config criteo_multihot_dcnv2 "$tables" \
        --train.batch_size=6912 --train.precision="$prec"
done

# DLE's step kernel by kernel (benchmarks/gpu_profile.py): where a GPU step's time goes
echo "-- profile dle-65536-tf32"
timeout 90 "$PY" benchmarks/gpu_profile.py --out "$OUT" --preset dle -- --train.precision=tf32 \
    >"$OUT/profile-dle.txt" 2>&1 || echo "   failed: see $OUT/profile-dle.txt"
grep -A9 "^== dle" "$OUT/profile-dle.txt" || true
# where A's step waits on the GPU (benchmarks/gpu_syncs.py): the forecast's host model
# rests on these read-backs (perfmodel/systems.py, RECSCALE)
echo "-- syncs A-16384-tf32"
timeout 60 "$PY" benchmarks/gpu_syncs.py --steps 2 --preset A -- --train.precision=tf32 \
    >"$OUT/syncs-A.txt" 2>&1 || echo "   failed: see $OUT/syncs-A.txt"
grep -A6 "^== A" "$OUT/syncs-A.txt" || true
# the host ops each bench stage dispatches on the GPU path (benchmarks/count_host_ops.py
# --stages): what a per-stage host model of a host-bound GPU step needs
for cfg in A B; do
    echo "-- host ops $cfg-16384-tf32"
    timeout 60 "$PY" benchmarks/count_host_ops.py recscale --config "$cfg" --device cuda \
        --stages --train.batch_size=16384 --train.precision=tf32 \
        >"$OUT/host-ops-$cfg.json" 2>"$OUT/host-ops-$cfg.log" \
        || echo "   failed: see $OUT/host-ops-$cfg.log"
    tail -c 400 "$OUT/host-ops-$cfg.json" | grep -o '"stage_ops": {[^}]*}' || true
done
fi

echo "== tests on cuda (RECSCALE_TEST_DEVICE=cuda) =="
# addopts' -q would cancel -v: with -v each result prints as it happens, so a run the
# budget stops still names the tests that failed before it
args=(-p no:cacheprovider -o addopts= -rfE)
"$PY" -c "import xdist" 2>/dev/null && args+=(-n "$WORKERS" -v)
"$PY" -c "import pytest_timeout" 2>/dev/null && args+=(--timeout=240)
base=${#args[@]}
left=0
if [ "$BUDGET_S" -gt 0 ]; then
    left=$((BUDGET_S - ($(date +%s) - START) - 20))
    [ "$left" -lt 30 ] && left=30
fi
# device code first, the files that never touch a device last (see the header)
host_only=(test_hostile_arguments test_hostile_commands test_hostile_files
    test_hostile_inputs test_import_layers test_forecast test_perfmodel test_config
    test_native_header test_planner test_torchrun test_criteo_data)
files=()
for f in tests/test_*.py; do
    [[ " ${host_only[*]} " == *" $(basename "$f" .py) "* ]] || files+=("$f")
done
for f in "${host_only[@]}"; do [ -f "tests/$f.py" ] && files+=("tests/$f.py"); done
if [ -n "$RESUME" ]; then
    [ -f "$RESUME" ] || { echo "gpu_check: RESUME=$RESUME: no such file" >&2; exit 2; }
    while read -r id; do args+=(--deselect "$id"); done < <(
        grep -oE "(PASSED|SKIPPED) tests/[^ ]+" "$RESUME" | awk '{print $2}' | sort -u)
    echo "resuming: $(((${#args[@]} - base) / 2)) tests of $RESUME done before, deselected"
fi
RECSCALE_TEST_DEVICE=cuda timeout "$left" "$PY" -m pytest "${args[@]}" "${files[@]}" 2>&1 \
    | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

"$PY" - "$OUT" "$tests_rc" <<'PYEOF'
import json, re, sys
from pathlib import Path
out, rc = Path(sys.argv[1]), int(sys.argv[2])
log = (out / "tests.log").read_text()
tail = log.strip().splitlines()
counts = {k: len(re.findall(rf"\b{k}\b tests/", log)) for k in ("PASSED", "FAILED", "ERROR")}
print("\n== summary ==")
print(f"tests (RECSCALE_TEST_DEVICE=cuda): {tail[-1] if tail else '?'} (exit {rc}"
      + (", stopped at the budget" if rc == 124 else "") + f"); per test: {counts}")
name = "?"
print(f"{'run':<18}{'samples/s':>12}{'bound':>12}{'ratio':>7}{'ms/step':>9}  stages (ms)")
for f in sorted(out.glob("bench-*.json")):
    try:
        r = json.loads(f.read_text())
    except ValueError:
        print(f"{f.stem[6:]:<18}{'failed':>12}")
        continue
    name = r.get("device_name", name)
    st = " ".join(f"{k} {v:.3f}" for k, v in {**r["stage_ms"], **r["stage_detail_ms"]}.items())
    print(f"{f.stem[6:]:<18}{r['samples_per_s']:>12,.0f}{r['bound_samples_per_s']:>12,.0f}"
          f"{r['ratio_to_bound']:>7.2f}{r['ms_per_step']:>9.2f}  {st}")
print(f"device: {name}")
PYEOF
exit "$tests_rc"
