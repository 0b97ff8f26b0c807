#!/usr/bin/env bash
# Token trees (issue 17), measured on this host in one sitting: nothing else may run meanwhile.
# Suffix decoding with token trees (modes suffix, hybrid) against the same without them
# (suffix-chain, hybrid-chain), warm, on the multi-session workloads, at the default block bound (8)
# and at 16 (room for branches); then code_twice through a local stack whose drafter sends trees.
# Writes docs/results/<host>/trees/*.json and prints the tables (scripts/suffix_table.py).
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${HOST:-$(lscpu | grep -qi amd && echo epyc || echo intel)}
OUT=docs/results/$HOST/trees
mkdir -p "$OUT"
T=.venv/bin/tandem
N=${N:-128}
lscpu > "$OUT/cpu.txt"
MODES=ar,ngram,suffix,suffix-chain,hybrid,hybrid-chain
$T bench -d code_twice -n "$N" --modes $MODES --suffix-warm --no-curve -o "$OUT/code_twice_warm.json" 2>>"$OUT/log.txt"
$T bench -d agent_tools -n "$N" --turns 2 --modes $MODES --suffix-warm --no-curve \
  -o "$OUT/agent_tools_warm.json" 2>>"$OUT/log.txt"
$T bench -d agent_tools -n "$N" --turns 2 -k 16 --modes ar,suffix,suffix-chain --suffix-warm --no-curve \
  -o "$OUT/agent_tools_warm_k16.json" 2>>"$OUT/log.txt"
PORT=${PORT:-50161}
$T up --grpc-port $PORT --http-port $((PORT + 1)) > "$OUT/stack_log.txt" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  grep -q "Tandem is up" "$OUT/stack_log.txt" 2>/dev/null && break
  sleep 1
done
$T bench --endpoint 127.0.0.1:$PORT -d code_twice -n "$N" --modes ar,ngram,suffix -o "$OUT/stack_code_twice.json" 2>>"$OUT/log.txt"
kill $UP; wait $UP 2>/dev/null || true
trap - EXIT
.venv/bin/python scripts/suffix_table.py "$OUT" ngram,suffix,suffix-chain,hybrid,hybrid-chain
