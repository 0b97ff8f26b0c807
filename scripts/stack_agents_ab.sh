#!/usr/bin/env bash
# The multi-session agent workload (issue 17) in process and through a local stack, alternated in
# one sitting: nothing else may run meanwhile. Through the stack every mode is a tenant of its own
# (`tandem bench --mode-tenants`), so its conversations are sessions: turn 2 reuses its KV, first
# turns reuse the tool list from an earlier session of the same mode, as in process.
# Writes docs/results/<host>/stack-agents/{inproc,stack}_<n>.json and prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/stack.sh
HOST=${HOST:-$(lscpu | grep -qi amd && echo epyc || echo intel-gguf)}
OUT=${OUT:-docs/results/$HOST/stack-agents}
mkdir -p "$OUT"
T=.venv/bin/tandem
N=${N:-128}
MODES=${MODES:-ar,ngram,suffix}
DATASET=${DATASET:-agent_tools}
PORT=${PORT:-50181}
lscpu > "$OUT/cpu.txt"
KEYS=$(mktemp)  # removed at the end (stack_up sets its own EXIT trap, so no trap here)
.venv/bin/python - "$MODES" > "$KEYS" <<'PY'
import json, secrets, sys
print(json.dumps({"tenants": {m: {"keys": [f"sk-bench-{m}-{secrets.token_hex(16)}"]} for m in sys.argv[1].split(",")}}))
PY
for r in $(seq 1 "${REPEAT:-1}"); do
  $T bench -d "$DATASET" -n "$N" --turns 2 --modes "$MODES" --suffix-warm --no-curve -o "$OUT/inproc_$r.json" 2>>"$OUT/log.txt"
  stack_up $T "$PORT" "$OUT/stack_log_$r.txt" --api-keys "$KEYS"
  $T bench --endpoint 127.0.0.1:$PORT --mode-tenants "$KEYS" -d "$DATASET" -n "$N" --turns 2 --modes "$MODES" \
    -o "$OUT/stack_$r.json" 2>>"$OUT/log.txt"
  stack_down
done
rm -f "$KEYS"
.venv/bin/python scripts/suffix_table.py "$OUT"
