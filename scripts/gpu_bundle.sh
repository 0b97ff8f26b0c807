#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a lent GPU machine that reaches no package index, made here
# (where an index is reachable), in .gpu/ (git-ignored):
#   .gpu/wheels/       the packages the source tree imports beyond what such a machine's image brings
#                      (its torch with CUDA, Triton, transformers and their dependencies are never
#                      bundled, so nothing shadows the machine's own), for that machine's Python;
#   .gpu/model.part-1, .gpu/model.part-2, .gpu/model.sha256
#                      the embedded GGUF in two parts: a device call carries at most 64 MiB.
#
#   scripts/gpu_bundle.sh [PYTHON_VERSION]      # default 3.12 (the H200 image's)
#
# Then two device calls, the machine kept warm between them (ignored files stay there):
#   1. carry .gpu/wheels and .gpu/model.part-1, command `ls .gpu`;
#   2. carry .gpu/model.part-2 and .gpu/model.sha256, command `scripts/gpu_check.sh`
#      (it joins the parts, checks the sha256 and uses .gpu/wheels by itself).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PIP=${PIP:-.venv/bin/pip}
PY=${PY:-.venv/bin/python}
W=.gpu/wheels
rm -rf "$W"
mkdir -p "$W"
# What the verifier's core imports (its step loop is part 5 of the check): gRPC and protobuf, the
# OpenTelemetry SDK and gRPC instrumentation, Prometheus metrics, Redis's client; and what the
# engine and the check import (pydantic, gguf, rich, typer).
"$PIP" download -q -d "$W" --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform linux_x86_64 \
  grpcio grpcio-health-checking grpcio-reflection protobuf pydantic gguf rich typer prometheus-client redis \
  opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc opentelemetry-instrumentation-grpc
# The machine's own scientific stack stays its own (gguf and others pull these in as dependencies).
for pkg in numpy torch nvidia_ triton sympy networkx mpmath jinja2 markupsafe fsspec filelock pyyaml PyYAML tqdm setuptools; do
  rm -f "$W"/"$pkg"*.whl
done
model=$("$PY" -c "from tandem.engine.model.paths import embedded_gguf_path; print(embedded_gguf_path())")
rm -f .gpu/model.part-*
# part 1 beside the wheels within one carry's 64 MiB, part 2 the rest
head -c $((44 << 20)) "$model" > .gpu/model.part-1
tail -c +$(((44 << 20) + 1)) "$model" > .gpu/model.part-2
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") | awk '{print $1}' > .gpu/model.sha256
echo "wheels for Python $PYV in $W ($(ls "$W" | wc -l) files); the model in two parts:"
du -sh "$W" .gpu/model.part-1 .gpu/model.part-2
