#!/usr/bin/env bash
# Suffix decoding (issue 17), measured on this host in one sitting: nothing else may run meanwhile.
#   1. the four dev sets in process, warm (the store fed by the earlier prompts' answers) with every
#      mode, and cold with the suffix modes;
#   2. the multi-session workloads (agent_tools, two turns; code_twice), warm;
#   3. code_twice through a local stack (`tandem up`), whose drafter's store warms itself.
# Writes docs/results/<host>/suffix/*.json and prints the tables (benchmarks/suffix_table.py).
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/stack.sh
bench_setup suffix
LIMIT=${LIMIT:-10}
N=${N:-128}
ALL=ar,ngram,suffix,model,hybrid-nosuffix,hybrid
for set in bfcl_multiple humaneval gsm8k mt_bench; do
  $T bench -d $set -l "$LIMIT" -n "$N" --modes $ALL --suffix-warm --no-curve -o "$OUT/${set}_warm.json" 2>>"$OUT/log.txt"
  $T bench -d $set -l "$LIMIT" -n "$N" --modes ar,ngram,suffix,hybrid --suffix-cold --no-curve -o "$OUT/${set}_cold.json" 2>>"$OUT/log.txt"
done
$T bench -d agent_tools -n "$N" --turns 2 --modes ar,ngram,suffix,hybrid-nosuffix,hybrid --suffix-warm --no-curve \
  -o "$OUT/agent_tools_warm.json" 2>>"$OUT/log.txt"
$T bench -d code_twice -n "$N" --modes ar,ngram,suffix,hybrid-nosuffix,hybrid --suffix-warm --no-curve \
  -o "$OUT/code_twice_warm.json" 2>>"$OUT/log.txt"
# Through the stack: the same first-turn workload, modes whose drafts a drafter makes. One mode
# feeds the store (suffix), so no prompt drafts from its own answer, as in process.
PORT=${PORT:-50151}
stack_up $T $PORT "$OUT/stack_log.txt"
$T bench --endpoint 127.0.0.1:$PORT -d code_twice -n "$N" --modes ar,ngram,suffix -o "$OUT/stack_code_twice.json" 2>>"$OUT/log.txt"
stack_down
.venv/bin/python benchmarks/suffix_table.py "$OUT"
