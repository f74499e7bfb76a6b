#!/usr/bin/env bash
# Check recscale on a CUDA machine in one command: install the project (nothing else:
# torch and triton must already be there, as on the GPU images), run the whole test
# suite on the GPU, then `recscale bench throughput` for configs A and B at batch 2048
# and 16384 (TF32, and bf16 at 16384), and print one summary table.
#
#   bash scripts/gpu_check.sh            # OUT=gpu_check/ gets the logs and JSON
#
# Exit code: the test suite's (the benchmarks report, they do not fail the check).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"

"$PY" - <<'PYEOF' || { echo "gpu_check: no CUDA device visible to torch" >&2; exit 2; }
import sys, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}")
sys.exit(0 if torch.cuda.is_available() else 1)
PYEOF
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "gpu_check: install failed, see $OUT/install.log" >&2; exit 2; }

echo "== tests on cuda (RECSCALE_TEST_DEVICE=cuda) =="
RECSCALE_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== bench throughput =="
for cfg in A B; do
    for bs in 2048 16384; do
        for prec in tf32 bf16; do
            [ "$prec" = bf16 ] && [ "$bs" = 2048 ] && continue
            name="$cfg-$bs-$prec"
            echo "-- $name"
            "$PY" -m recscale bench throughput --config "$cfg" --steps 50 --json \
                --train.batch_size="$bs" --train.precision="$prec" --train.device=cuda \
                >"$OUT/bench-$name.json" 2>"$OUT/bench-$name.log" \
                || echo "   failed: see $OUT/bench-$name.log"
        done
    done
done

"$PY" - "$OUT" "$tests_rc" <<'PYEOF'
import json, sys
from pathlib import Path
out, rc = Path(sys.argv[1]), int(sys.argv[2])
tail = (out / "tests.log").read_text().strip().splitlines()
print("\n== summary ==")
print(f"tests (RECSCALE_TEST_DEVICE=cuda): {tail[-1] if tail else '?'} (exit {rc})")
print(f"{'run':<16}{'samples/s':>14}{'bound':>14}{'ratio':>8}{'ms/step':>10}  device")
for f in sorted(out.glob("bench-*.json")):
    try:
        r = json.loads(f.read_text())
    except ValueError:
        print(f"{f.stem[6:]:<16}{'failed':>14}")
        continue
    print(f"{f.stem[6:]:<16}{r['samples_per_s']:>14,.0f}{r['bound_samples_per_s']:>14,.0f}"
          f"{r['ratio_to_bound']:>8.2f}{r['ms_per_step']:>10.2f}  {r.get('device_name', '?')}")
PYEOF
exit "$tests_rc"
