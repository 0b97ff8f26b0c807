#!/usr/bin/env bash
# One-session speed of two builds, alternated in one sitting (nothing else may run meanwhile):
#   benchmarks/ab_builds.sh OLD_PYTHON NEW_PYTHON OUT_DIR [ROUNDS]
# Each PYTHON is a virtualenv's interpreter with that build installed (e.g. a copy of .venv with
# `pip install --no-deps -e <other checkout>`). Every round runs `tandem bench` on MT-Bench and
# HumanEval (10 prompts, 128 tokens, plain decoding and prompt lookup) with the old build, then the
# new; benchmarks/ab_table.py then compares each prompt's best round of the two.
set -euo pipefail
OLD=$1 NEW=$2 OUT=$(realpath -m "$3") ROUNDS=${4:-8} HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
lscpu > "$OUT/cpu.txt"
cd /tmp  # neither checkout's folders on sys.path
for round in $(seq "$ROUNDS"); do
  for side in old new; do
    PY=$OLD; [ "$side" = new ] && PY=$NEW
    for set in mt_bench humaneval; do
      "$PY" -m tandem.tools.cli bench -d $set -l 10 -n 128 --modes ar,ngram --no-curve \
        -o "$OUT/${side}_${set}_r${round}.json" > /dev/null 2>>"$OUT/log.txt"
    done
  done
done
python3 "$HERE/ab_table.py" "$OUT"
