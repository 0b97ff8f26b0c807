#!/usr/bin/env bash
# Suffix decoding through a local stack, two builds alternated in one sitting (nothing else may run):
#   scripts/stack_suffix_ab.sh OLD_CHECKOUT OUT_DIR [ROUNDS]
# OLD_CHECKOUT is another checkout with its own .venv (`make install` there); this checkout is "new".
# Per run: `tandem bench --endpoint` on code_twice (ar, suffix) and the services' step and
# draft-ahead counters scraped from their /metrics before the stack stops; a summary at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/stack.sh
OLD=$(realpath "$1"); OUT=$2; ROUNDS=${3:-4}
mkdir -p "$OUT"
lscpu > "$OUT/cpu.txt"
run() { # tag tandem-executable
  stack_up "$2" 50151 "$OUT/stack_log_$1.txt" || return 1
  .venv/bin/tandem bench --endpoint 127.0.0.1:50151 -d code_twice -n 128 --modes ar,suffix \
    -o "$OUT/stack_$1.json" 2>>"$OUT/log.txt"
  for u in $(grep -o 'http://127.0.0.1:[0-9]*/metrics' "$OUT/stack_log_$1.txt"); do
    curl -s "$u" | grep -E "^tandem_(speculative_blocks|verify_steps|step_phase_seconds_(sum|count))"
  done > "$OUT/metrics_$1.txt"
  stack_down
}
tags=()
for r in $(seq "$ROUNDS"); do
  run "old$r" "$OLD/.venv/bin/tandem" && tags+=("old$r")
  run "new$r" "$PWD/.venv/bin/tandem" && tags+=("new$r")
done
.venv/bin/python - "$OUT" "${tags[@]}" <<'PY' | tee "$OUT/summary.txt"
import json, re, sys
out = sys.argv[1]
for tag in sys.argv[2:]:
    modes = json.load(open(f"{out}/stack_{tag}.json"))["modes"]
    metrics = open(f"{out}/metrics_{tag}.txt").read()
    phase = lambda p: float(re.search(r'phase_seconds_sum\{phase="%s"\} (\S+)' % p, metrics).group(1))
    used = re.search(r'outcome="used"\} (\S+)', metrics)
    ar, sx = modes["ar"], modes["suffix"]
    print(f"{tag}: ar {ar['tokens_per_s']:.1f} tok/s, suffix {sx['tokens_per_s']:.1f} tok/s, whole-run "
          f"{sx['tokens_per_s'] / ar['tokens_per_s']:.3f}x, median {sx['speedup_vs_ar']:.3f}x, {sx['steps']} steps; "
          f"verifier phases (s, both modes) plan {phase('plan'):.2f} forward {phase('forward'):.2f}; "
          f"draft-ahead blocks used {used.group(1) if used else '?'}")
PY
