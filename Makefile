# Everything a newcomer types: `make demo`, `make test`. Only python3 (>= 3.11) and make needed.

PYTHON ?= python3
VENV ?= .venv
# torch is installed first and on its own, so that a machine can pick its build, e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url <a CUDA or CPU wheel index>'
# The default takes the CPU wheel that pip finds in /opt/wheels on our dev and CI machines.
TORCH_SPEC ?= torch==2.13.0
PIP_SPEC ?= pip==26.3
PIP_FLAGS ?= --quiet --disable-pip-version-check

BIN := $(VENV)/bin
STAMP := $(VENV)/.kvmesh-installed
TORCH_STAMP := $(VENV)/.torch-spec
CHECKED := app cache events tests tools

.PHONY: setup native browser demo test lint fmt typecheck pytest clean FORCE

setup: native

# Rewritten only when TORCH_SPEC changes, so a new spec re-runs the install.
$(TORCH_STAMP): FORCE
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

# Debian's chromium, for the dashboard's browser test (Playwright drives it; no browser
# download). Installed when missing and we are root with apt-get (CI); elsewhere the test skips.
browser:
	@if command -v chromium >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
		echo "no chromium (and no root apt-get): the dashboard's browser test will skip"; \
	fi

# browser is order-only: it is checked every time, but never re-runs the pip installs.
$(STAMP): pyproject.toml constraints.txt $(TORCH_STAMP) | browser
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) --upgrade '$(PIP_SPEC)'
	$(BIN)/python -m pip install $(PIP_FLAGS) $(TORCH_SPEC) -c constraints.txt
	$(BIN)/python -m pip install $(PIP_FLAGS) -e '.[dev]' -c constraints.txt
	@touch $@

# cache/'s hot modules compiled with mypyc, in place (tools/build_native.py, a few minutes): a
# no-op while the build matches the sources; where it cannot be built, cache/ runs as Python.
native: $(STAMP)
	$(BIN)/python tools/build_native.py

demo: native
	$(BIN)/kvmesh demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: $(STAMP)
	$(BIN)/mypy $(CHECKED)

# The suite on PYTEST_WORKERS processes (pytest-xdist), a test file to each at a time (a
# module's fixtures run once): 5.5 min instead of 8.8 on a 2-core machine, where most tests
# wait on the services they start. PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2

pytest: $(STAMP)
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

# pytest last: its summary line is the last line of output (CI reads it).
test: lint typecheck native pytest

# A long random run of the cache state machine against its model (about 1,000 runs of 80 steps,
# minutes), before and after changes to cache/'s hot paths. KVMESH_HYPOTHESIS_EXAMPLES=N sets
# the number of runs; a failure prints the seed and the blob to reproduce it.
.PHONY: test-long
test-long: native
	KVMESH_HYPOTHESIS=long $(BIN)/pytest --timeout=0 tests/cache/test_state_machine.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
	rm -f cache/*.so cache/native.digest
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +

FORCE:
