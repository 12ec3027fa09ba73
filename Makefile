# Two commands do everything on a fresh machine:
#   make demo   - set up .venv, convert the bundled example model, train it in onnxruntime; then the
#                 digits run (examples/digits.py: a CNN on scikit-learn's digits, bridge vs torch, out/digits.png)
#   make test   - set up .venv and run the test suite (what CI runs)
# Tiers: make test-fast (the edit loop: no slow, no exhaustive), make test-all (also the exhaustive
# tier: the whole ONNX node suite with gradients, every op-database row through IREE, ...).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-all venv clean system-deps

# pip byte-compiles all it installs (~50 s of CPU, 15,000 files). Kept: `--no-compile` saved those 50 s
# (measured 2026-11-30), but this machine's environment sets PYTHONDONTWRITEBYTECODE=1, so every later
# Python process would compile what it imports (torch + bridge: +8 s of CPU each, two pytest workers,
# spawned ranks and CLI subprocesses); `compileall -j 0` afterwards took 77 s of CPU and exits 1 on a
# file that does not compile.
# No constraints file either: `pip install --dry-run` of '.[test,iree]' in a fresh venv (2026-12-01, load 3-10,
# three runs each, alternating) took 22.6-28.1 s of CPU as it is and 25.2-27.4 s with `-c` of the 91 resolved `==`
# pins (wall 46-296 s vs 76-202 s, set by the load): the resolver does not backtrack; its time is fetching indexes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,iree]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/digits.py out

# Debian's chromium renders `bridge show --html` pictures headless in the tests.
system-deps:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# Two workers: the machines here have 2 cores. loadgroup hands each test to whichever worker is
# free, in the order tests/conftest.py gives (slow tests first, so none ends up alone at the tail),
# and keeps the tests of one expensive module-scoped fixture on one worker; each worker runs torch
# on one thread (tests/conftest.py).
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=15

test: $(STAMP) system-deps
	$(PYTEST) -m "not exhaustive" tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not exhaustive" tests

test-all: $(STAMP) system-deps
	$(PYTEST) tests

clean:
	rm -rf $(VENV) out
