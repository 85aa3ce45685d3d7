# The two front-door commands (README.md):  make demo  |  make test
# Each creates what it needs on a fresh machine and reuses venvs that already match pyproject.toml.
PY ?= python3
VENV := .venv
XLA_VENV := .venv-xla

.PHONY: demo test test-fast lint test-main test-main-a test-main-b test-xla test-xla-a test-xla-b test-heavy venv venv-xla

venv: $(VENV)/.codex-installed
venv-xla: $(XLA_VENV)/.codex-installed

# Main venv: torch 2.13.0 (the CPU wheel; an unpinned torch would pull GBs of CUDA wheels).
$(VENV)/.codex-installed: pyproject.toml pipeline/clean/_wordcount.c
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,hf,tasks,ray]'
	touch $@

# XLA venv: torch_xla 2.9.0 needs torch 2.9.0 exactly; runs the real XLA path with PJRT_DEVICE=CPU,
# and libtpu's TPU compiler in compile-only mode (tpu-aot: codex train --compile-only).
$(XLA_VENV)/.codex-installed: pyproject.toml pipeline/clean/_wordcount.c
	test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.9.0 torch_xla==2.9.0
	$(XLA_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,tpu-aot]'
	touch $@

demo: venv
	$(VENV)/bin/codex demo

# pytest exits 5 when it collects no test: that fails `make test` on purpose (a suite that runs
# nothing must not pass). The main and XLA suites' halves run side by side: most of the main
# suite's time is spent waiting on its subprocesses, and an XLA compile uses one core, so four
# runs share 2 cores well (and on a fresh machine the XLA venv installs while the main suite runs).
test: lint
	$(MAKE) -j4 --output-sync=target test-main-a test-main-b test-xla-a test-xla-b

# Under 5 minutes on 2 cores: no slow, heavy or XLA test (no subprocess job, no Ray cluster).
test-fast: venv
	$(VENV)/bin/python -m pytest -m "not slow and not heavy and not xla" -q

# ruff (lint + format, pinned in pyproject.toml) on the whole tree, mypy on the packages.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The main suite in two halves of about equal time: the data side, checkpoints and the loader,
# then the rest of training, the model and eval.
MAIN_A := tests/core tests/cli tests/e2e tests/pipeline tests/train/checkpoint tests/train/data
MAIN_B := tests/train tests/model tests/eval --ignore=tests/train/checkpoint --ignore=tests/train/data

test-main: test-main-a test-main-b

test-main-a: venv
	$(VENV)/bin/python -m pytest -m "not xla and not heavy" -q --durations=15 $(MAIN_A)

test-main-b: venv
	$(VENV)/bin/python -m pytest -m "not xla and not heavy" -q --durations=15 $(MAIN_B)

# Checks too long for every run (minutes each on 2 cores), e.g. stacked Muon on 7b's shapes.
test-heavy: venv venv-xla
	$(VENV)/bin/python -m pytest -m "heavy and not xla" -q
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -m "heavy and xla" -q

# The XLA suite in two halves of about equal time: the fsdp, step and TPU-compile programs, then
# the rest (the runs against eager, attention, hosts, the model and eval under XLA).
XLA_B := tests/train/xla/test_xla_fsdp.py tests/train/xla/test_xla_step.py \
	tests/train/xla/test_xla_program.py tests/train/xla/test_tpu_compile.py
XLA_A := tests $(addprefix --ignore=,$(XLA_B))

test-xla: test-xla-a test-xla-b

test-xla-a: venv-xla
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -m "xla and not heavy" -q --durations=15 $(XLA_A)

test-xla-b: venv-xla
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -m "xla and not heavy" -q --durations=15 $(XLA_B)
