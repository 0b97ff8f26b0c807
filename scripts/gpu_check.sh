#!/usr/bin/env bash
# The CUDA check of issue 14 (scripts/gpu_check.py), unattended, bounded to 8 minutes.
#
#   scripts/gpu_check.sh [--out FILE] [--model PATH] [--batches 1,8,32] [--sessions 1,16]
#
# Which Python runs it:
# - the checkout's .venv where it exists (make install; on a GPU host with a package index:
#   make install TORCH=torch TORCH_INDEX= first, so pip brings torch's CUDA build);
# - else, where the system python3 already has torch with CUDA and Triton (a GPU machine that reaches
#   no package index), that python3 over the source tree laid out as the package installs it
#   (tandem/, kernels/ as tandem.kernels, services/ as tandem.services) in a temporary folder; Python
#   packages it lacks go in from the wheels in $TANDEM_WHEELS (a folder), with no index;
# - else make install.
# What scripts/gpu_bundle.sh made and a device call carried (.gpu/) is used by itself: its wheels as
# TANDEM_WHEELS, and its model parts, joined and checked against their sha256, as --model.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi || echo "nvidia-smi: not found (no NVIDIA driver here)"
if [ -z "${TANDEM_WHEELS:-}" ] && [ -d .gpu/wheels ]; then
    TANDEM_WHEELS=.gpu/wheels
fi
if [ -f .gpu/model.part-1 ] && [ -f .gpu/model.part-2 ] && [ -f .gpu/model.sha256 ] && [[ " $* " != *" --model "* && " $* " != *" --model="* ]]; then
    cat .gpu/model.part-1 .gpu/model.part-2 > .gpu/model.gguf
    if [ "$(sha256sum .gpu/model.gguf | awk '{print $1}')" != "$(cat .gpu/model.sha256)" ]; then
        echo "the joined model's sha256 is not .gpu/model.sha256's: a part is missing or damaged" >&2
        exit 2
    fi
    echo "model: .gpu/model.gguf (joined from its two parts, sha256 checked)"
    set -- --model .gpu/model.gguf "$@"
fi
if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
elif python3 -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=python3
    src=$(mktemp -d)
    mkdir -p "$src/tandem"
    cp -r tandem/. "$src/tandem/"
    cp -r kernels "$src/tandem/kernels"
    cp -r services "$src/tandem/services"
    if [ -n "${TANDEM_WHEELS:-}" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$src/site" "$TANDEM_WHEELS"/*.whl
    fi
    export PYTHONPATH="$src:$src/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "running the source tree with $(command -v python3) from $src (no .venv, no package index)"
else
    make install
    PY=.venv/bin/python
fi
timeout 480 "$PY" scripts/gpu_check.py "$@"
