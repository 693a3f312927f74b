# The two quick-start commands. Each sets up its own virtual environment on a fresh machine.
#   make demo   build the embedded demo model into ./dist (no network needed beyond pip)
#   make test   run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# two stamps: the demo needs packer and the CPU torch only; the tests add the test extras
DEMO_STAMP := $(VENV)/.packer-demo-installed
STAMP := $(VENV)/.packer-installed
INSTALL_LOG := $(VENV)/install.log
# extra pip options for the torch install alone: plain PyPI serves Linux x86_64 the CUDA build
# of torch==2.13.0; TORCH_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# gets the CPU one (what Dockerfile.runtime does). This project's machines serve the CPU build.
TORCH_PIP_ARGS ?=

.PHONY: demo test test-slow lint package-check clean

# pip's output goes to a log that is shown only if the install fails: a quick start prints
# the stage table, not pip's notes about this machine's package indexes.
$(DEMO_STAMP): pyproject.toml requirements/torch-cpu.txt
	@echo "setting up $(VENV) (torch and packer; log: $(INSTALL_LOG))"
	@python3 -m venv $(VENV)
	@( $(PY) -m pip install --upgrade pip \
	   && $(PY) -m pip install $(TORCH_PIP_ARGS) -r requirements/torch-cpu.txt \
	   && $(PY) -m pip install -e . ) > $(INSTALL_LOG) 2>&1 \
	   || { tail -n 40 $(INSTALL_LOG); exit 1; }
	@touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	@echo "adding the test tools to $(VENV) (transformers, diffusers, ruff, mypy...; log: $(INSTALL_LOG))"
	@$(PY) -m pip install -e '.[test]' >> $(INSTALL_LOG) 2>&1 || { tail -n 40 $(INSTALL_LOG); exit 1; }
	@touch $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/packer build -o dist

# one pytest worker per core, each test file on one worker (its module-scoped builds made once);
# the slow tests (killed builds, tensor-parallel ranks, fresh-process self-tests) are a run of their
# own, which .ci/run runs too
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check packer tests benchmarks
	$(VENV)/bin/mypy

# Install as users install: wheel + sdist, a fresh venv with only the CPU torch and the wheel.
package-check:
	bash .ci/packaging

clean:
	rm -rf dist out benchmarks/_work
