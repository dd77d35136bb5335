# The two set-up commands: `make serve` and `make test`. Both create .venv when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The suite mostly waits (servers, clients, timeouts): three processes share the two
# cores of the machines it runs on. PYTEST_ARGS="-n 0" runs it in one.
PYTEST_ARGS ?= -n 3

.PHONY: serve test check lint format bench clean lock deploy-test bench-lb soak

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/proxy serve

test: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python -m bench.hits

# The image and the compose stack on a real Docker engine (deploy/test_stack.py). Where
# public images cannot be pulled, ../shared/tools/docker-standins provides the engine and
# local stand-ins of the base images under the same names.
deploy-test: $(STAMP)
	$(BIN)/python deploy/test_stack.py

bench-lb: $(STAMP)
	$(BIN)/python -m bench.lb

# Three replicas on Postgres under load while replicas, Postgres, the upstream and the
# disk fail (bench/soak.py); exits 1 on a wrong body, a 500 or anything left behind.
SOAK_DURATION ?= 20m
soak: $(STAMP)
	$(BIN)/python -m bench.soak --duration $(SOAK_DURATION)

# The image installs requirements.lock (runtime dependencies + the image's init, with
# hashes) and builds the project with requirements-build.lock (the build backend).
# Regenerate both after changing dependencies in pyproject.toml: `make lock` (it also pins
# the S3 server of the compose stack's object-storage variant, deploy/s3/).
LOCK_FLAGS := --universal --python-version 3.11 --generate-hashes --quiet
lock: $(STAMP)
	$(BIN)/uv pip compile $(LOCK_FLAGS) --output-file requirements.lock \
	  pyproject.toml deploy/image-requirements.in
	$(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
	  | $(BIN)/uv pip compile $(LOCK_FLAGS) --output-file requirements-build.lock -
	$(BIN)/uv pip compile $(LOCK_FLAGS) --output-file deploy/s3/requirements.lock deploy/s3/requirements.in

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
