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

# the compatibility and detector tests, run again with CPU tensors on the accelerators' path
# (tests/test_reads.py runs each of its tests on both paths itself); and where that path's deferred
# reads decide the outcome: a pass interrupted with reads pending, a GradScaler's backoff told from
# a detection, a tensor an in-place collective writes before its read; a removed detector that
# frees the model, passes begun inside others (a forward in a backward hook, nested detectors), and
# a Where line that is right or silent
DEVICE_PATH_TESTS := tests/test_compat_rules.py tests/test_compat_transformers.py tests/test_compat_random.py \
	tests/test_detector.py tests/test_watch.py tests/test_options.py tests/test_skip.py tests/test_training_setups.py tests/test_find_op.py \
	tests/test_interrupted_passes.py tests/test_grad_scaler.py tests/test_distributed_collectives.py tests/test_step.py \
	tests/test_remove_frees_the_model.py tests/test_reentrant_passes.py tests/test_where_right_or_silent.py
# and again as if the compiled modules could not be loaded (the torch backend reads, the Python twin of
# HookCore keeps the rows): reports identical to the reference on that path too, the rows of an
# interrupted pass dropped, a row not reused once a collective wrote its tensor (async: once its work
# completed), and the model freed after remove()
NO_EXTENSION_TESTS := tests/test_compat_rules.py tests/test_compat_transformers.py tests/test_detector.py tests/test_reads.py \
	tests/test_interrupted_passes.py tests/test_distributed_collectives.py \
	tests/test_step.py tests/test_remove_frees_the_model.py tests/test_reentrant_passes.py tests/test_where_right_or_silent.py
# the inner loop: unit, exactness and compatibility core (the kernel's exactness on this CPU's build)
FAST_TESTS := tests/test_compat_rules.py tests/test_compat_transformers.py tests/test_detector.py \
	tests/test_reads.py tests/test_watch.py tests/test_options.py tests/test_skip.py tests/test_training_setups.py tests/test_stats_torch.py \
	tests/test_amd_float8.py
FAST_KERNEL := (random_bit or special_values or every_byte or empty_and_zero or non_contiguous) and not default-
PYTEST := $(PY) -m pytest -q -n 2

.PHONY: setup test test-fast test-versions demo report-demo bench clean

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

# the runs on the other paths leave out the tests that check nothing the path decides (one_path)
test: $(DEV)
	$(PYTEST) tests
	OVERFLOW_FAST_CPU_AS_DEVICE=1 $(PYTEST) $(DEVICE_PATH_TESTS) -m "not one_path"
	OVERFLOW_FAST_WITHOUT_EXTENSION=1 $(PYTEST) $(NO_EXTENSION_TESTS) -m "not one_path"

test-fast: $(DEV)
	$(PYTEST) $(FAST_TESTS) tests/test_cpu_backend.py -k "not test_cpu_backend or ($(FAST_KERNEL))"

# the tested range (docs/install.md): the tests that depend on torch and transformers, on each
# Python/torch/transformers combination in tests/versions_matrix.py, each torch in a venv of its
# own under $OVERFLOW_FAST_VERSIONS_DIR (default ~/.cache/overflow_fast-versions), made once and
# reused; torch's CUDA wheels make each a few GB. Not part of `make test` or CI (pinned versions).
test-versions:
	$(PYTHON) tests/versions_matrix.py

demo: $(RUNTIME)
	$(PY) -m overflow_fast.demo

# a recorded run that drifts into an fp16 overflow -> build/report-demo.jsonl and build/report-demo.png
report-demo: $(DEV)
	$(PY) -m overflow_fast.report_demo

# the whole suite, quick settings (<= 10 minutes on 2 cores): one table, benchmarks/results/bench.csv
bench: $(DEV)
	$(PY) benchmarks/bench_all.py

clean:
	rm -rf build dist *.egg-info overflow_fast/*.so overflow_fast/_prebuilt
