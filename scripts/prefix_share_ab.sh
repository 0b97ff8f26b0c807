#!/usr/bin/env bash
# The multi-session workloads (issue 17) in process with and without prefix sharing
# (`tandem bench --share-prefix/--no-share-prefix`), alternated in one sitting: nothing else may run.
#   agent_tools   12 two-turn sessions behind one ~1,300-token tool list, answers as text
#   agent_calls   the same sessions as API tools under the call grammar (--tools required): JSON calls
#   code_twice    HumanEval prompts asked twice, renamed the second time
# Writes docs/results/<host>/prefix-share/<workload>_<share|noshare>_<n>.json and prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${HOST:-$(lscpu | grep -qi amd && echo epyc || echo intel-gguf)}
OUT=docs/results/$HOST/prefix-share
mkdir -p "$OUT"
T=.venv/bin/tandem
N=${N:-128}
MODES=${MODES:-ar,ngram,suffix}
REPEAT=${REPEAT:-1}
lscpu > "$OUT/cpu.txt"
for r in $(seq 1 "$REPEAT"); do
  for share in share noshare; do
    flag=--$([ $share = share ] && echo share-prefix || echo no-share-prefix)
    $T bench -d agent_tools -n "$N" --turns 2 --modes "$MODES" --suffix-warm --no-curve $flag \
      -o "$OUT/agent_tools_${share}_$r.json" 2>>"$OUT/log.txt"
    $T bench -d agent_tools -n "$N" --turns 2 --tools required --modes "$MODES" --suffix-warm --no-curve $flag \
      -o "$OUT/agent_calls_${share}_$r.json" 2>>"$OUT/log.txt"
    $T bench -d code_twice -n "$N" --modes "$MODES" --suffix-warm --no-curve $flag \
      -o "$OUT/code_twice_${share}_$r.json" 2>>"$OUT/log.txt"
  done
done
.venv/bin/python scripts/suffix_table.py "$OUT"
