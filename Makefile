# qvl: two commands do all set-up on a fresh machine.
#   make demo  - bootstrap .venv, then run the pipeline end to end with a tiny model (CPU, or a GPU if present)
#   make test  - bootstrap .venv, then run the test suite
#   make bench - bootstrap .venv, then run the benchmarks (JSON + table under .bench/)
#   make bench-train - the training benchmark (benchmarks/bench_train.py; real shapes on a GPU)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.qvl-bootstrapped
# Python 3.12 is required (megatron-core >= 0.17, megatron-bridge >= 0.4). On these machines it is pyenv's 3.12.1;
# a pyenv shim that is not set to 3.12 is skipped because it fails the version check.
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d $$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)/versions/3.12*/bin/python3 2>/dev/null | sort -V -r); do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v "$$p"; break; }; done)
PYTEST_ARGS ?=
# Two pytest-xdist workers (the build machines have 2 cores; one worker alone keeps about one busy). Test files
# stay whole on a worker, and the files sharing a fixture built once share it (tests/conftest.py).
TEST_WORKERS ?= 2
# uv, or pip (the fallback where uv is not at hand).
INSTALLER ?= uv

.PHONY: venv test demo bench bench-train clean-venv slurm-ahead install-with-uv install-with-pip

venv: $(STAMP)

$(STAMP): launchers/requirements-stack.txt launchers/requirements-nodeps.txt pyproject.toml
	@if [ ! -x "$(PY)" ]; then \
	  if [ -z "$(PYTHON312)" ]; then echo "error: no Python 3.12 found; install it (pyenv install 3.12) or pass PYTHON312=/path/to/python3.12" >&2; exit 1; fi; \
	  echo "creating $(VENV) with $(PYTHON312)"; "$(PYTHON312)" -m venv $(VENV); \
	fi
	@# uv installs the same pins as pip (same versions resolved) in a third of the time: the stack took 34 s with uv,
	@# 115 s with pip on a 2-core build machine (most of it ~4 GB of CUDA wheels that pip fetches and unpacks one at a
	@# time). Where uv cannot be installed or cannot reach an index (it reads no pip.conf), pip does it: INSTALLER=pip.
	@if [ "$(INSTALLER)" = uv ] && $(PY) -m pip install -q uv && $(MAKE) --no-print-directory install-with-uv; then :; \
	else echo "installing with pip"; $(MAKE) --no-print-directory install-with-pip; fi
	@touch $@

# Bytecode: none is compiled ahead (compiling all 25k files of the environment took 85 s on two cores; a process
# imports ~6.4k of them). `make test`, `demo` and `bench` let Python write what it imports (PYTHONDONTWRITEBYTECODE
# unset there), so each module is compiled once, by the first process that imports it.
install-with-uv:
	$(VENV)/bin/uv pip install -q --python $(PY) -r launchers/requirements-stack.txt setuptools wheel
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps -r launchers/requirements-nodeps.txt
	$(VENV)/bin/uv pip install -q --python $(PY) --no-build-isolation -e '.[test]'

install-with-pip:
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q --no-compile -r launchers/requirements-stack.txt
	$(PY) -m pip install -q --no-compile --no-deps -r launchers/requirements-nodeps.txt
	$(PY) -m pip install -q --no-compile --no-build-isolation -e '.[test]'

test: slurm-ahead $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The real-Slurm tests apt-get Slurm where it is missing (as root); for the whole suite that install starts here, in
# the background, so it overlaps building the environment instead of the Slurm tests' worker (the tests take the same
# lock, then find it done).
slurm-ahead:
	@if [ -z "$(PYTEST_ARGS)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null && ! command -v slurmctld > /dev/null \
	  && [ -n "$(PYTHON312)" ]; then \
	  nohup "$(PYTHON312)" tests/launchers/slurm_cluster.py > "$${TMPDIR:-/tmp}/qvl-slurm-ahead.log" 2>&1 & \
	fi

demo: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/qvl demo

bench: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m benchmarks.run

# Training throughput at real shapes on a GPU (tiny model on CPU); BENCH_TRAIN_ARGS="--model qwen3_vl_4b --layers 8"
bench-train: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m benchmarks.bench_train $(BENCH_TRAIN_ARGS)

clean-venv:
	rm -rf $(VENV)
