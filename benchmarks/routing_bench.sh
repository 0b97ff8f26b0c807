#!/usr/bin/env bash
# Routing shown to pay (issue 61): the gateway's residency routing against the baselines that
# ignore what verifiers hold (round-robin, least-loaded), same sitting, alternating: `tandem up`
# with 3 verifiers whose KV budgets are small enough that sessions are evicted, and `tandem
# loadtest -d agent_turns` (four-turn agent sessions sharing one tool list, each in its own
# session) at 32 sessions; TTFT p50/p90, the cached share of prompt tokens, tokens/s, and what
# the verifiers did (--metrics). Nothing else may run meanwhile.
#
#   benchmarks/routing_bench.sh       # docs/results/<host>/routing/<policy>[_N].json
#   REPEAT=3 POLICIES=residency,round-robin KV=6000 SESSIONS=32 DATASET=agent_tools TURNS=2 benchmarks/routing_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/stack.sh
bench_setup "${SUBDIR:-routing}"
PORT=${PORT:-50191}
git log -1 --format='%h %s' > "$OUT/build.txt"
for i in $(seq "${REPEAT:-1}"); do  # the policies alternate within each repeat
  suffix=$([ "$i" = 1 ] && echo "" || echo "_$i")
  for policy in $(echo "${POLICIES:-residency,round-robin,least-loaded}" | tr , ' '); do
    name="$policy$suffix"
    stack_up $T "$PORT" "$OUT/${name}_stack_log.txt" --verifiers 3 --verifier-threads 1 --routing "$policy" \
      --verifier-kv-capacity-tokens "${KV:-6000}"
    metrics=$(grep -o 'http://[^ ]*/metrics   (verifier[^)]*)' "$OUT/${name}_stack_log.txt" | awk '{print $1}' | paste -sd,)
    $T loadtest --endpoint 127.0.0.1:$((PORT + 1))  -d "${DATASET:-agent_turns}" -c "${SESSIONS:-32}" --strategy suffix \
      --turns "${TURNS:-4}" --conversations "${CONVERSATIONS:-1}" --duration "${DURATION:-120}" --metrics "$metrics" \
      -o "$OUT/$name.json" 2>&1 | tee "$OUT/${name}_log.txt"
    stack_down
  done
done
