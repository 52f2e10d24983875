# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench soak kill-soak clean compiled

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The per-read modules compiled with mypyc (docs/compiled.md): a no-op while the build
# matches its sources, rebuilt when one changed; without mypyc or a C compiler, pure
# Python (phony: the build's manifest knows what it depends on, make cannot say it).
compiled: $(STAMP)
	$(BIN)/python -m tracer.compiled build
	@# bytecode written once (where PYTHONDONTWRITEBYTECODE is set, every tracer process
	@# would otherwise compile its modules again: about 0.1 s of CPU each)
	$(BIN)/python -m compileall -q tracer

venv: $(STAMP) compiled

demo: compiled
	$(BIN)/tracer demo

LINT_DIRS := $(wildcard tracer addons tests bench)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_DIRS)
	$(BIN)/ruff format --check $(LINT_DIRS)
	$(BIN)/mypy

# tests/unit, tests/integration, tests/e2e (`pytest -m "not e2e"`: the quick loop). Four
# workers on two cores: most tests spend their time waiting on sockets and processes.
TEST_WORKERS ?= 4
test: lint compiled
	$(BIN)/pytest -q -n $(TEST_WORKERS)

# The peers and wrk come from Debian; py-spy only for `--profile`.
bench: compiled
	@command -v nginx >/dev/null && command -v wrk >/dev/null || \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light wrk >/dev/null)
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.analysis
	$(BIN)/python -m bench.fleet
	$(BIN)/python -m bench.replay_fidelity
	$(BIN)/python -m bench.loadgen_ceiling
	$(BIN)/python -m bench.run --scenarios addon --rounds 5 --duration 5
	$(BIN)/python -m bench.addon_hooks
	$(BIN)/python -m bench.addon_instructions
	$(BIN)/python -m bench.fault_layer

# The readers fuzzed (tests/fuzz, hypothesis's `fuzz` profile): over 100,000 inputs across
# the capture, pcap, TCP, head, framing and SSE readers; the inputs per target at the end.
.PHONY: fuzz
fuzz: $(STAMP)
	TRACER_FUZZ=1 $(BIN)/pytest -q -n 2 -p no:cacheprovider tests/fuzz --timeout=1800

# 10 minutes at C=256 of mixed traffic through the tap: records lost, RSS and descriptors.
soak: compiled
	$(BIN)/python -m bench.soak --duration 600 --concurrency 256
	$(BIN)/python -m bench.kill_soak --kills 20

# kill -9 of a loaded tap at 20 random moments (seeded): every capture reads, and every
# request completed more than FLUSH_INTERVAL + 0.5 s before the kill is in it (~1 minute).
kill-soak: compiled
	$(BIN)/python -m bench.kill_soak --kills 20

clean:
	rm -rf $(VENV) demo-out bench-out build
