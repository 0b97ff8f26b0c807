#!/usr/bin/env bash
# Many agent sessions (issue 62): `tandem loadtest` on agent_tools (two-turn sessions sharing one
# 1,260-token tool list) at 1, 4, 16, 32 and 64 sessions, plain and with suffix decoding, through a
# local stack with default settings, and what the verifier did in each phase (--metrics: prefill
# computed / reused / shared / recomputed after evictions, rows per step, KV occupancy). Nothing
# else may run meanwhile.
#
#   benchmarks/sessions_bench.sh            # docs/results/<host>/sessions/<NAME>.json (NAME=sessions; REPEAT=3 -> _2, _3)
#   NAME=before LEVELS=1,4,64 benchmarks/sessions_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/stack.sh
bench_setup sessions
PORT=${PORT:-50181}
NAME=${NAME:-sessions}
git log -1 --format='%h %s' > "$OUT/${NAME}_build.txt"
for i in $(seq "${REPEAT:-1}"); do
  suffix=$([ "$i" = 1 ] && echo "" || echo "_$i")
  stack_up $T "$PORT" "$OUT/${NAME}${suffix}_stack_log.txt"
  metrics=$(grep -o 'http://[^ ]*/metrics   (verifier[^)]*)' "$OUT/${NAME}${suffix}_stack_log.txt" | awk '{print $1}' | paste -sd,)
  $T loadtest --endpoint 127.0.0.1:$((PORT + 1)) -d agent_tools -c "${LEVELS:-1,4,16,32,64}" --strategy suffix \
    --duration "${DURATION:-45}" --metrics "$metrics" -o "$OUT/${NAME}${suffix}.json" 2>&1 | tee "$OUT/${NAME}${suffix}_log.txt"
  stack_down
done
