#!/usr/bin/env bash
# Many agent sessions (issue 62): `tandem loadtest` on agent_tools (two-turn sessions sharing one
# 1,260-token tool list) at 1, 4, 16, 32 and 64 sessions, plain and with suffix decoding, through a
# local stack with default settings, and what the verifier did in each phase (--metrics: prefill
# computed / reused / shared / recomputed after evictions, rows per step, KV occupancy). Nothing
# else may run meanwhile.
#
#   benchmarks/sessions_bench.sh            # docs/results/<host>/sessions/<NAME>.json (NAME=sessions; REPEAT=3 -> _2, _3)
#   NAME=before LEVELS=1,4,64 benchmarks/sessions_bench.sh     # SUBDIR=... another folder
#   BEFORE=52ffbe9 REPEAT=3 benchmarks/sessions_bench.sh
#       before/after in one sitting, alternating: the stack built from BEFORE (a git worktree with
#       its own editable install, sharing this checkout's packages), then this checkout's, the same
#       client for both: before.json, after.json, before_2.json, after_2.json, ...
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/stack.sh
bench_setup "${SUBDIR:-sessions}"
PORT=${PORT:-50181}
NAME=${NAME:-sessions}
run() {  # run TANDEM NAME
  stack_up "$1" "$PORT" "$OUT/${2}_stack_log.txt" ${UP_ARGS:-}
  metrics=$(grep -o 'http://[^ ]*/metrics   (verifier[^)]*)' "$OUT/${2}_stack_log.txt" | awk '{print $1}' | paste -sd,)
  $T loadtest --endpoint 127.0.0.1:$((PORT + 1)) -d agent_tools -c "${LEVELS:-1,4,16,32,64}" --strategy suffix \
    --duration "${DURATION:-45}" --metrics "$metrics" ${EXTRA:-} -o "$OUT/${2}.json" 2>&1 | tee "$OUT/${2}_log.txt"
  stack_down
}

if [ -n "${BEFORE:-}" ]; then
  before_tree "$BEFORE" "${TREE:-}"
  git -C "$TREE" log -1 --format='before: %h %s' > "$OUT/builds.txt"
  git log -1 --format='after: %h %s' >> "$OUT/builds.txt"
fi
for i in $(seq "${REPEAT:-1}"); do
  suffix=$([ "$i" = 1 ] && echo "" || echo "_$i")
  if [ -n "${BEFORE:-}" ]; then
    run "$TREE/.venv/bin/tandem" "before$suffix"
    run $T "after$suffix"
  else
    git log -1 --format='%h %s' > "$OUT/${NAME}_build.txt"
    run $T "$NAME$suffix"
  fi
done
