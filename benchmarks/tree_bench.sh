#!/usr/bin/env bash
# Token trees (issue 17), measured on this host in one sitting: nothing else may run meanwhile.
# Suffix decoding with token trees (modes suffix, hybrid) against the same without them
# (suffix-chain, hybrid-chain), warm, on the multi-session workloads, at the default block bound (8)
# and at 16 (room for branches); then code_twice through a local stack whose drafter sends trees.
# Writes docs/results/<host>/trees/*.json and prints the tables (benchmarks/suffix_table.py).
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/stack.sh
bench_setup trees
N=${N:-128}
MODES=ar,ngram,suffix,suffix-chain,hybrid,hybrid-chain
$T bench -d code_twice -n "$N" --modes $MODES --suffix-warm --no-curve -o "$OUT/code_twice_warm.json" 2>>"$OUT/log.txt"
$T bench -d agent_tools -n "$N" --turns 2 --modes $MODES --suffix-warm --no-curve \
  -o "$OUT/agent_tools_warm.json" 2>>"$OUT/log.txt"
$T bench -d agent_tools -n "$N" --turns 2 -k 16 --modes ar,suffix,suffix-chain --suffix-warm --no-curve \
  -o "$OUT/agent_tools_warm_k16.json" 2>>"$OUT/log.txt"
PORT=${PORT:-50161}
stack_up $T $PORT "$OUT/stack_log.txt"
$T bench --endpoint 127.0.0.1:$PORT -d code_twice -n "$N" --modes ar,ngram,suffix -o "$OUT/stack_code_twice.json" 2>>"$OUT/log.txt"
stack_down
.venv/bin/python benchmarks/suffix_table.py "$OUT" ngram,suffix,suffix-chain,hybrid,hybrid-chain
