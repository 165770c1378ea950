# The two entry points of the README: `make demo` (install, then the main job) and `make test`.
#
# Everything goes into a project virtualenv, $(VENV) (created with `$(PY) -m venv`); `make` never installs
# into the Python it finds on PATH. Steps, each skipped when its inputs have not changed:
#   1. $(VENV)              the virtualenv
#   2. $(DEPS_STAMP)        torch ($(TORCH_SPEC)) and the build tools ($(BUILD_TOOLS), the range
#                           pyproject.toml's build-system requires); redone when TORCH_SPEC changes
#   3. $(DEV_STAMP)         `make test` only: the `dev` extra (pytest, hypothesis, triton, transformers, Lightning,
#                           ...) from pyproject.toml, without building gaengine._C; redone when pyproject.toml or torch
#                           changed. Before the build: pip's downloads and unpacking use one core at most, which leaves
#                           the other to .ci/run's torch range job (niced), while the build takes both
#   4. $(BUILD_STAMP)       `pip install -e .`: gaengine, its base dependencies (numpy, tqdm, matplotlib) and
#                           gaengine._C compiled from csrc/ (the CPU ops alone on a CPU build of torch), MAX_JOBS
#                           files at once (default: one per core), its progress shown: a line per file compiled and,
#                           while one still compiles, one every 30 s; the whole log in $(BUILD_LOG). Redone when
#                           csrc/, setup.py, pyproject.toml or torch changed, or when the compiled module is missing.
#                           All that `make demo` installs (`gaengine train` needs nothing more)
#   5. `gaengine info`      what was built and what loads: gaengine._C, CPU ops, CUDA kernels, hooks, triton
# TORCH_SPEC pins the torch build; override it for a CUDA machine, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url <the CUDA wheel index>"
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
# One step at a time, even under `make -j`: every step but the compile (MAX_JOBS) runs pip in the one virtualenv.
.NOTPARALLEL:

PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip install --disable-pip-version-check
# The build tools, in the tested range of pyproject.toml's [build-system] requires (tests/test_packaging.py checks
# that the two lists agree).
BUILD_TOOLS := "setuptools>=77.0.3,<85" "wheel>=0.45,<0.49" "ninja>=1.11,<1.14" "pybind11>=2.13,<3.2"
# Compiler processes at once (torch's cpp_extension passes it to ninja as -j): one per core.
MAX_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
DEPS_STAMP := $(VENV)/.gaengine-deps
BUILD_STAMP := $(VENV)/.gaengine-built
DEV_STAMP := $(VENV)/.gaengine-dev
DEV_REQUIREMENTS := $(VENV)/dev-requirements.txt
BUILD_LOG := $(VENV)/build.log
SPEC_FILE := $(VENV)/.torch-spec
EXT_SOURCES := setup.py pyproject.toml $(shell find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null)

# A build stamp without the compiled module beside the sources (deleted by hand) is stale: the next make
# builds it again.
ifneq ($(wildcard $(BUILD_STAMP)),)
ifeq ($(wildcard gaengine/_C*.so gaengine/_C*.pyd),)
$(shell rm -f $(BUILD_STAMP))
endif
endif

.PHONY: install info demo test test-deps bench FORCE

install: $(BUILD_STAMP)
	@echo "== gaengine info"
	@$(VPY) -m gaengine info || echo "gaengine info failed: gaengine does not import (the error is above)"

info: $(BUILD_STAMP)
	@$(VPY) -m gaengine info

demo: install
	$(VPY) -m gaengine train

# The suite on $(TEST_WORKERS) pytest-xdist workers (auto: one per core), a file's tests on one worker (--dist
# loadfile: a module's fixtures are built once), the files with multi-process or slow tests handed out first
# (tests/conftest.py; --no-loadscope-reorder keeps that order, where xdist would hand out the files with the most
# tests first and leave a few-test, minutes-long file to run alone at the end), the 25 slowest tests listed at the
# end (--durations=25: what a CI log needs to see where its time goes). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= auto
test: $(DEV_STAMP) install
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# What `make test` installs first, in its order, without running the suite.
test-deps: $(DEV_STAMP) $(BUILD_STAMP)

bench: install
	$(VPY) benchmarks/bench_accumulate.py

$(VPY):
	@echo "== creating the virtualenv $(VENV) with $(PY) ($$($(PY) --version))"
	$(PY) -m venv $(VENV)

# Rewritten only when TORCH_SPEC changes, so that a new torch (and a rebuild against it) follows.
$(SPEC_FILE): FORCE | $(VPY)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(DEPS_STAMP): $(SPEC_FILE)
	@echo "== installing $(TORCH_SPEC) and the build tools into $(VENV)"
	$(PIP) $(TORCH_SPEC)
	$(PIP) -q $(BUILD_TOOLS)
	@touch $@

# The build's progress, as it happens (sed -u): ninja's [k/n] line per source file, setup.py's own
# "gaengine: ..." lines (each once: setup.py runs twice; among them its "still compiling <files> (1 min 30 s;
# ...)" line every 30 s while the compiler is silent), compiler errors; everything in $(BUILD_LOG).
$(BUILD_STAMP): $(DEPS_STAMP) $(EXT_SOURCES)
	@echo "== building gaengine._C from csrc/ ($(MAX_JOBS) files at once) and installing gaengine (editable) into $(VENV)"
	@echo "   compiler progress below (a line every 30 s at least); the whole log: $(BUILD_LOG)"
	@rm -f gaengine/_C*.so  # so that a failed build cannot leave an older module looking current
	@MAX_JOBS=$(MAX_JOBS) $(PIP) --no-build-isolation -v -e . 2>&1 | tee $(BUILD_LOG) \
	  | sed -nuE -e 's#$(CURDIR)/##g' \
	      -e '/^ *gaengine: /{s/^ *//;x;G;/^(.*)\n\1$$/!s/.*\n/   /p;d}' \
	      -e 's/^ *(\[[0-9]+\/[0-9]+\]) .* -c ([^ ]+) -o .*/   \1 \2/p' \
	      -e 's/^ *[^ ]+ .* -shared .*/   linked gaengine._C/p' \
	      -e '/ error: |^ *FAILED: |^ *error: /p'
	@touch $@

# The dev extra's requirements, read from pyproject.toml (tomllib; pip's own copy of tomli on Python 3.10) and
# installed as requirements: `pip install -e ".[dev]"` would build gaengine._C again.
$(DEV_STAMP): $(DEPS_STAMP) pyproject.toml
	@echo "== installing the test suite's dependencies (pyproject.toml's dev extra) into $(VENV)"
	@$(VPY) -c 'import sys; \
	  exec("try: import tomllib\nexcept ImportError: from pip._vendor import tomli as tomllib"); \
	  sys.stdout.write("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]) + "\n")' \
	  > $(DEV_REQUIREMENTS)
	$(PIP) -r $(DEV_REQUIREMENTS)
	@touch $@

FORCE:

# The torch range gaengine claims (docs/install.md), .ci/torch_range.sh:
#   make torch-headers  csrc/*.cpp compiled against the oldest and the newest supported torch's headers (2.9.1 and
#                       2.14.1), in minutes, nothing installed
#   make torch-ci       both versions installed, gaengine._C built against each and the CI subset of the smoke tests
#                       run there (CI runs it beside the suite, on one core, niced)
#   make torch-newest   torch 2.14.1 (the newest supported) in a scratch virtualenv, gaengine._C built against it and
#                       the smoke subset run (by hand: docs/install.md; the virtualenv, 5.6 GB, is kept and reused)
#   make torch-oldest   the same for torch 2.9.1 (the oldest supported: a CUDA wheel and its nvidia-* wheels
#                       downloaded, several GB on first use)
#   make torch-range    all of it: both versions' headers, then both smoke runs
# Run `make torch-range` before each submission that touches csrc/ or gaengine/compat.py.
.PHONY: torch-range torch-headers torch-ci torch-newest torch-oldest
torch-range:
	PYTHON=$(PY) bash .ci/torch_range.sh full

torch-headers:
	PYTHON=$(PY) bash .ci/torch_range.sh headers 2.9.1 2.14.1

torch-ci:
	PYTHON=$(PY) bash .ci/torch_range.sh ci

torch-newest:
	PYTHON=$(PY) bash .ci/torch_range.sh smoke 2.14.1

torch-oldest:
	PYTHON=$(PY) bash .ci/torch_range.sh smoke 2.9.1

# The frameworks' own accumulation tests, plainly and through gaengine (tests/external/run_framework_tests.py): give
# the checkouts, e.g. make framework-tests FRAMEWORKS="--transformers ../transformers@v5.24.0 --lightning
# ../pytorch-lightning@2.6.5 --fabric ../pytorch-lightning@2.6.5 --accelerate ../accelerate@v1.14.0". Slow (minutes);
# not part of `make test`.
.PHONY: framework-tests
FRAMEWORKS ?=
framework-tests: $(DEV_STAMP) install
	$(VPY) tests/external/run_framework_tests.py $(FRAMEWORKS)
