# Quick start: `make demo` and `make test` each set up .venv from nothing, then run.
# The C++ kernel is not built here: the first import builds it for this torch and CPU and caches
# it (`.venv/bin/overflow-fast info` says where).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# numpy: torch warns at every import without it
TORCH_PIN := torch==2.13.0 numpy
export MAX_JOBS ?= 2
# what the demo needs: torch and the package
RUNTIME := $(VENV)/.overflow_fast-runtime
# and the test, benchmark and packaging tools (pyproject's extras)
DEV := $(VENV)/.overflow_fast-dev

.PHONY: setup test demo report-demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(RUNTIME): $(PY) pyproject.toml setup.py
	if $(PY) -c "import torch" 2>/dev/null; then $(PY) -m pip install --quiet -e .; \
	else $(PY) -m pip install --quiet $(TORCH_PIN) -e .; fi
	touch $(RUNTIME)

$(DEV): $(RUNTIME)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(DEV)

setup: $(DEV)

test: $(DEV)
	$(PY) -m pytest -q tests

demo: $(RUNTIME)
	$(PY) -m overflow_fast.demo

# a recorded run that drifts into an fp16 overflow -> build/report-demo.jsonl and docs/report-demo.png
report-demo: $(DEV)
	$(PY) -m overflow_fast.report_demo

# the whole suite, quick settings (<= 10 minutes on 2 cores): one table, benchmarks/results/bench.csv
bench: $(DEV)
	$(PY) benchmarks/bench_all.py

clean:
	rm -rf build dist *.egg-info overflow_fast/*.so overflow_fast/_prebuilt
