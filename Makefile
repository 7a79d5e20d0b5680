# Zooid: `make run` trains the default job on the local stack; `make test` runs the suite.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
PREFECT_DB := .venv/.prefect-db

.PHONY: install run up down test lint bench clean redis azurite

$(STAMP): requirements.txt requirements-dev.txt requirements.lock pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -r requirements.txt -c requirements.lock
	$(PIP) install -q --no-compile -r requirements-dev.txt
	$(PIP) install -q --no-compile --no-deps -e .
	@# byte-compiled on every core at once, not by pip one file at a time (44 s against 33 s here); a
	@# package's own unparseable files (templates, other Pythons' code) are skipped, as pip skips them
	$(PY) -c 'import compileall, sysconfig; compileall.compile_dir(sysconfig.get_path("purelib"), quiet=2, workers=0)'
	touch $(STAMP)

## the Prefect database a new Prefect home starts from (deployments/prefect_db.py)
$(PREFECT_DB): $(STAMP)
	$(PY) -m deployments.server db-template
	touch $(PREFECT_DB)

install: $(STAMP) $(PREFECT_DB)

## run: start the local stack, train the default job through train/local, print the report, stop everything
run: install
	$(PY) -m deployments.stack run $(foreach p,$(PARAMS),--param $(p))

## up / down: leave the local stack running for the Prefect UI (writes .zooid/env)
up: install
	$(PY) -m deployments.stack up

down:
	@if [ -x $(PY) ]; then $(PY) -m deployments.stack down; fi

redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server; fi; }

## azurite: Azure's Blob API emulator (npm package azurite) in .azurite/, for the Azure Blob store's tests
AZURITE := .azurite/node_modules/.bin/azurite-blob
azurite: $(AZURITE)
$(AZURITE):
	npm install --prefix .azurite --no-audit --no-fund --loglevel=error azurite@3.35.0

## lint: pyflakes' checks (undefined names, unused imports and variables, ...) over the whole tree
lint: $(STAMP)
	$(PY) -m ruff check --select F --output-format concise .

## test: install (redis-server, Azurite, the container engine and the worker image included), lint, run the whole
## suite in TEST_PROCS processes (whole files each, so a module's servers start once; TEST_PROCS=0: one process)
TEST_PROCS ?= 3
PACKAGES := blocks clouds comm coordinator core deployments engine flows planners profiling runtime tasks
test:
	$(MAKE) --no-print-directory -j3 $(STAMP) redis azurite  # npm and apt wait on I/O while pip installs
	$(MAKE) --no-print-directory -j3 $(PREFECT_DB) lint compile  # the template's server waits on I/O too
	@began=$$(date +%s); $(MAKE) --no-print-directory image; \
	  echo "make test: the worker image took $$(( $$(date +%s) - began )) s (counted apart from the suite's time)"
	$(PY) -m pytest -q -p no:cacheprovider --timeout=600 $(if $(filter 0,$(TEST_PROCS)),,-n $(TEST_PROCS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

## compile: the project's modules byte-compiled once: where PYTHONDONTWRITEBYTECODE is set (this machine
## sets it), every process of the suite would otherwise compile each module it imports again
.PHONY: compile
compile: $(STAMP)
	$(PY) -m compileall -q -j 0 $(PACKAGES)

bench: install redis azurite
	$(PY) -m benchmarks.run_all

## image: build the CPU worker image here (mmdebstrap base, local wheelhouse, no registry); a no-op when current
.PHONY: image
image: install
	$(PY) -m deployments.images build

clean: down
	rm -rf .zooid
