# The two entry points of the README: `make demo` (install, then the main job) and `make test`.
# TORCH_SPEC pins the torch build; override it for a CUDA machine, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PY ?= python3
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install demo test bench

install:
	$(PIP) $(TORCH_SPEC)
	$(PIP) "setuptools>=64" wheel ninja pybind11
	$(PIP) --no-build-isolation -e ".[dev]"

demo: install
	$(PY) -m gaengine train

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/bench_accumulate.py
