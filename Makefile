# One entry point for people and CI. `make test` is the README's test command.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test install rust-test py-test lint bench demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	rm -f python/kvblock/_core*.so
	$(BIN)/python -m pip install -q -e ".[test,bench,torch]"
	$(BIN)/python -m pip install -q --no-deps vllm==0.33.0
	$(BIN)/python -m pip install -q -r requirements/vllm-cpu-test.txt

rust-test:
	cargo test --release

py-test: install
	$(BIN)/python -m pytest -q

test: rust-test py-test

# Formatting and clippy, warnings as errors (CI's lint job).
lint:
	cargo fmt --check
	cargo clippy --features python --all-targets -- -D warnings

bench: install
	$(BIN)/python -m pytest benches -q --benchmark-columns=min,median,mean,rounds --benchmark-sort=name
	cargo bench --bench core
	cargo bench --bench index

demo: $(BIN)/python
	$(BIN)/python -m pip install -q .
	$(BIN)/python -m kvblock info

clean:
	rm -rf target $(VENV) python/kvblock/_core*.so .pytest_cache .hypothesis .benchmarks
