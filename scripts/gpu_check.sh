#!/usr/bin/env bash
# The CUDA check of issue 14 (scripts/gpu_check.py), unattended, bounded to 8 minutes.
#
#   scripts/gpu_check.sh [--out FILE] [--model PATH] [--batches 1,8,32]
#
# Which Python runs it:
# - the checkout's .venv where it exists (make install; on a GPU host with a package index:
#   make install TORCH=torch TORCH_INDEX= first, so pip brings torch's CUDA build);
# - else, where the system python3 already has torch with CUDA and Triton (a GPU machine that reaches
#   no package index), that python3 over the source tree laid out as the package installs it
#   (tandem/, kernels/ as tandem.kernels, services/ as tandem.services) in a temporary folder; Python
#   packages it lacks go in from the wheels in $TANDEM_WHEELS (a folder), with no index;
# - else make install.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi || echo "nvidia-smi: not found (no NVIDIA driver here)"
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
