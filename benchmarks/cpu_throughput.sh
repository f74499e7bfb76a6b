#!/usr/bin/env bash
# The CPU speed benchmark: configs A and B (see src/recscale/configs/A.toml, B.toml),
# each three times (this VM's run-to-run spread is a few percent), JSON lines out.
set -euo pipefail
for cfg in A B; do
  for i in 1 2 3; do
    recscale bench throughput --config "$cfg" --steps "${STEPS:-60}" --json 2>/dev/null | python3 -c \
      "import json,sys; r=json.load(sys.stdin); print(json.dumps({k: r[k] for k in ('config','samples_per_s','samples_per_s_mean','bound_samples_per_s','ratio_to_bound','peak_rss_bytes','model_state_bytes','stage_ms')}))"
  done
done
