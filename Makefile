# Two commands do everything on a fresh machine:
#   make demo   - set up .venv, convert the bundled example model, train it in onnxruntime
#   make test   - set up .venv and run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean system-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Debian's chromium renders `bridge show --html` pictures headless in the tests.
system-deps:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

test: $(STAMP) system-deps
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) out
