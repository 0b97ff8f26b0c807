#!/usr/bin/env bash
# Concurrency sweep through a local stack (issue 14): `tandem loadtest` at 1, 8, 16, 32 and 64
# sessions, speculation off and on, MT-Bench, 2 turns of 64 tokens. Nothing else may run meanwhile.
# Writes docs/results/<host>/mixed/sweep.json (+ .png).
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${HOST:-$(lscpu | grep -qi amd && echo epyc || echo intel)}
OUT=docs/results/$HOST/mixed
mkdir -p "$OUT"
T=.venv/bin/tandem
PORT=${PORT:-50171}
$T up --grpc-port $PORT --http-port $((PORT + 1)) > "$OUT/sweep_stack_log.txt" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  grep -q "Tandem is up" "$OUT/sweep_stack_log.txt" 2>/dev/null && break
  sleep 1
done
$T loadtest --endpoint 127.0.0.1:$((PORT + 1)) -d mt_bench -c "${LEVELS:-1,8,16,32,64}" --turns 2 --max-tokens 64 \
  --duration "${DURATION:-90}" -o "$OUT/sweep.json"
