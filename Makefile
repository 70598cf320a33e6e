# Quick start: `make demo` and `make test` each set up .venv from nothing, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.overflow_fast-installed
TORCH_PIN := torch==2.13.0
export MAX_JOBS ?= 2

.PHONY: setup test demo report-demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall (and rebuild the C++ kernel) whenever the build inputs change.
$(STAMP): $(PY) pyproject.toml setup.py requirements-dev.txt $(wildcard csrc/*.cpp csrc/*.h)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) -m overflow_fast.demo

# a recorded run that drifts into an fp16 overflow -> build/report-demo.jsonl and docs/report-demo.png
report-demo: setup
	$(PY) -m overflow_fast.report_demo

# the whole suite, quick settings (<= 10 minutes on 2 cores): one table, benchmarks/results/bench.csv
bench: setup
	$(PY) benchmarks/bench_all.py

clean:
	rm -rf build *.egg-info overflow_fast/*.so
