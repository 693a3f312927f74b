# The two quick-start commands. Each sets up its own virtual environment on a fresh machine.
#   make demo   build the embedded demo model into ./dist (no network needed beyond pip)
#   make test   run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.packer-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first, so pip does not pick a multi-GB CUDA build for the package.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/packer build -o dist

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check packer tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf dist out benchmarks/_work
