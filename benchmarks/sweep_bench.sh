#!/usr/bin/env bash
# Concurrency sweep through a local stack (issue 14): `tandem loadtest` at 1, 8, 16, 32 and 64
# sessions, speculation off and on, MT-Bench, 2 turns of 64 tokens. Nothing else may run meanwhile.
#
#   benchmarks/sweep_bench.sh              # this checkout: docs/results/<host>/mixed/sweep.json (+ .png; OUT=dir elsewhere)
#   BEFORE=c603e97 benchmarks/sweep_bench.sh
#       before/after in one sitting: the stack built from BEFORE (a git worktree with its own
#       editable install, sharing this checkout's packages), then this checkout's, the same client
#       (this checkout's loadtest) for both: sweep_before.json and sweep_after.json. REPEAT=2 runs
#       each build's sweep twice, alternating (sweep_after_2.json ...), to see the noise.
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/stack.sh
HOST=${HOST:-$(lscpu | grep -qi amd && echo epyc || echo intel)}
OUT=${OUT:-docs/results/$HOST/mixed}
mkdir -p "$OUT"
T=.venv/bin/tandem
PORT=${PORT:-50171}
lscpu | grep "Model name" > "$OUT/sweep_cpu.txt"

sweep() {  # sweep TANDEM NAME
  stack_up "$1" "$PORT" "$OUT/${2}_stack_log.txt"
  $T loadtest --endpoint 127.0.0.1:$((PORT + 1)) -d mt_bench -c "${LEVELS:-1,8,16,32,64}" --turns 2 --max-tokens 64 \
    --conversations "${CONVERSATIONS:-1}" --duration "${DURATION:-90}" -o "$OUT/$2.json"
  stack_down
}

if [ -z "${BEFORE:-}" ]; then
  sweep $T sweep
  exit 0
fi
before_tree "$BEFORE" "${TREE:-}"
git -C "$TREE" log -1 --format='before: %h %s' > "$OUT/sweep_builds.txt"
git log -1 --format='after: %h %s' >> "$OUT/sweep_builds.txt"
for i in $(seq "${REPEAT:-1}"); do
  suffix=$([ "$i" = 1 ] && echo "" || echo "_$i")
  sweep "$TREE/.venv/bin/tandem" "sweep_before$suffix"
  sweep $T "sweep_after$suffix"
done
