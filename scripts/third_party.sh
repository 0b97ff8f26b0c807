#!/usr/bin/env bash
# Third-party clients against a local stack (docs/benchmarks.md, "Third-party clients"):
#   guidellm (load: concurrency 1, 2, 4 on MT-Bench first turns, speculation off and on),
#   tandem loadtest on the same prompts and concurrencies, for comparison,
#   lm-eval (GSM8K from the bundled prompt set tandem/tools/prompts/ through local-chat-completions, speculation off and on).
# The clients go into their own virtualenv ($CLIENTS_VENV, default .venv-clients) with the CPU torch
# wheel first (lm-eval depends on torch; a plain index would bring the CUDA build). Minutes each;
# nothing else CPU-heavy may run meanwhile. Results land in docs/results/<host>/third_party/.
#
#   scripts/third_party.sh [intel|epyc]      (the results folder; default: from lscpu)
#
# Smaller runs (a check that it all works): GUIDELLM_REQUESTS=2 LOADTEST_CONVERSATIONS=1 LM_EVAL_LIMIT=2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VENV=${CLIENTS_VENV:-.venv-clients}
HOST=${1:-$(lscpu | grep -q AMD && echo epyc || echo intel)}
OUT=docs/results/$HOST/third_party
PORT=${PORT:-8011}
mkdir -p "$OUT"

if [ ! -x "$VENV/bin/guidellm" ] || [ ! -x "$VENV/bin/lm_eval" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0   # the CPU wheel on these machines
  "$VENV/bin/pip" install -q "guidellm==0.8.1" "lm-eval[api]==0.4.13"
fi
TOK=$($PY -c "from tandem.engine.model.loading import convert_gguf; from tandem.engine.model.paths import embedded_gguf_path; print(convert_gguf(embedded_gguf_path(), progress=False))")
$PY - <<'PYEOF'
import json
with open("/tmp/tandem_mt_bench_prompts.jsonl", "w") as f:
    for line in open("tandem/tools/prompts/mt_bench_question.jsonl"):
        f.write(json.dumps({"prompt": json.loads(line)["turns"][0]}) + "\n")
PYEOF
lscpu | grep "Model name" | tee "$OUT/cpu.txt"
"$VENV/bin/pip" list 2>/dev/null | grep -E "^(guidellm|lm_eval|torch) " | tee "$OUT/versions.txt"

stack() {  # $1: the gateway's default strategy
  .venv/bin/tandem up --http-port "$PORT" --grpc-port $((PORT + 100)) --speculation "$1" >"$OUT/stack_$1.log" 2>&1 &
  STACK=$!
  for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return; sleep 1; done
  echo "the stack did not start: $OUT/stack_$1.log" >&2; exit 1
}
stop() { kill -INT "$STACK"; wait "$STACK" || true; }

stack ngram
for s in none ngram; do
  "$VENV/bin/guidellm" run \
    --backend "{\"kind\": \"openai_http\", \"target\": \"http://127.0.0.1:$PORT\", \"model\": \"default\", \"max_tokens\": 128, \"extras\": {\"body\": {\"speculation\": {\"strategy\": \"$s\"}}}}" \
    --profile kind=concurrent --override profile.streams 1,2,4 \
    --data kind=json_file,path=/tmp/tandem_mt_bench_prompts.jsonl --tokenizer "kind=hf_auto,model=$TOK" \
    --constraint "kind=max_requests,count=${GUIDELLM_REQUESTS:-8}" --output "kind=json,path=$OUT/guidellm_$s.json" --disable-progress \
    | tee "$OUT/guidellm_$s.txt"
done
.venv/bin/tandem loadtest --endpoint "127.0.0.1:$PORT" -d mt_bench --turns 1 -c 1,2,4 --conversations "${LOADTEST_CONVERSATIONS:-4}" --duration 120 --max-tokens 128 \
  --out "$OUT/loadtest.json" | tee "$OUT/loadtest.txt"
stop

for s in none ngram; do   # lm-eval cannot send Tandem's field: the gateway's default decides
  stack "$s"
  "$VENV/bin/lm_eval" --model local-chat-completions \
    --model_args "model=default,base_url=http://127.0.0.1:$PORT/v1/chat/completions,num_concurrent=1,max_retries=1" \
    --apply_chat_template --include_path scripts/lm_eval_tasks --tasks tandem_gsm8k --limit "${LM_EVAL_LIMIT:-20}" \
    --log_samples --output_path "$OUT/lm_eval_$s" | tee "$OUT/lm_eval_$s.txt"
  stop
done
