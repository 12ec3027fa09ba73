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
# onnx-mlir (its backend and test tier): ONNX_MLIR_HOME, else the build beside the clone, if any.
ONNX_MLIR_HOME ?= $(wildcard $(abspath ../shared/onnx-mlir/install))
export ONNX_MLIR_HOME

.PHONY: demo test test-fast test-all lint venv clean system-deps notebooks

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,iree]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/digits.py out

# The comparison notebooks: each notebooks/<name>.py (jupytext) executed and saved as <name>.ipynb
# with its outputs; tests/test_notebooks.py checks the saved outputs are current.
notebooks: $(STAMP)
	$(PY) notebooks/render.py

# Debian packages the tests use: chromium renders `bridge show --html` pictures headless; onnx-mlir
# (ONNX_MLIR_HOME, ../shared/onnx-mlir/README.md) runs on LLVM 22's libraries and links each model
# with clang-22. Installed only where missing; onnx-mlir's only where an onnx-mlir is present.
ONNX_MLIR_APT := libllvm22 libprotobuf32 llvm-22 clang-22 binutils libstdc++-12-dev
system-deps:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	@command -v node >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null; }
	@[ -d examples/web/node_modules ] || (cd examples/web && npm ci --no-audit --no-fund --silent)
	@if [ -n "$$ONNX_MLIR_HOME" ] && [ -x "$$ONNX_MLIR_HOME/bin/onnx-mlir" ] && ! command -v clang++-22 >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(ONNX_MLIR_APT) >/dev/null; fi

# Two workers: the machines here have 2 cores. loadgroup hands each test to whichever worker is
# free, in the order tests/conftest.py gives (slow tests first, so none ends up alone at the tail),
# and keeps the tests of one expensive module-scoped fixture on one worker; each worker runs torch
# on one thread (tests/conftest.py).
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=15

test: $(STAMP) system-deps lint
	$(PYTEST) -m "not exhaustive" tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not exhaustive" tests

test-all: $(STAMP) system-deps
	$(PYTEST) tests

# ruff (pyflakes, bugbear, isort, pyupgrade) everywhere; mypy on the public API, the contract, the
# runtime and the IR (pyproject.toml's [tool.ruff] and [tool.mypy]).
lint: $(STAMP)
	$(PY) -m ruff check bridge tests docs benchmarks examples notebooks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) out
