# The two commands a new user types: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs (pins: pyproject.toml).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
SUM     := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# The demo's install skips byte-compiling (--no-compile: 16 s less of a fresh install; modules are
# compiled as they are first imported).  The tests' install compiles, on every core, the packages
# every test process imports (scripts/precompile.py: attnlab's requirements, pytest, hypothesis,
# triton and what they require; compiling them on first import inside the run slowed the spawned
# ranks of the distributed fault tests past their bounds).  pip would compile all of the venv on
# one core (a fresh install 58 s, 32 s of it compiling); all of it on 2 cores took 22 s, these 7 s.
# The rest (transformers' model folders, pandas, scipy, ...: the tests import a tenth of it)
# compiles on first import, once: bytecode is written (a PYTHONDONTWRITEBYTECODE in the caller's
# environment would make every worker and spawned process compile attnlab, the test modules and
# those packages again, and pytest rewrite every test module's asserts again: 11 s of collection
# per worker instead of 5).
unexport PYTHONDONTWRITEBYTECODE
# Two stamps: the demo needs attnlab and transformers (the pretrained MiniLM) only; the
# tests add pytest, triton, transformer-lens (with wandb, datasets, pandas, pyarrow) and
# playwright.  The test stamp implies the demo one (a superset is installed).
DEMO_STAMP := $(VENV)/.installed-demo-$(SUM)
STAMP      := $(VENV)/.installed-test-$(SUM)

.PHONY: demo test lint bench venv clean

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	test -f $(STAMP) || $(BIN)/python -m pip install -q --no-compile -e '.[transformers]'
	rm -f $(VENV)/.installed-demo-*
	touch $(DEMO_STAMP)

# The tests' install comes in two steps: attnlab's own requirements (torch, ninja, ...: CORE, read
# from pyproject.toml's dependencies), then the native kernel's two builds start in the background
# (tests/ops/native/portable.py; ~50 s of compiling) on the core pip leaves idle while it installs
# the extras (~20 s on one core); the tests find them built or wait on the build under way.
CORE := $(shell sed -n '/^dependencies = \[/,/^\]/s/^ *"\([^"]*\)".*/\1/p' pyproject.toml)
ifeq ($(filter torch==%,$(CORE)),)
$(error pyproject.toml: no pinned torch in its `dependencies = [...]` block (one quoted requirement per line), CORE read "$(CORE)")
endif

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile $(CORE)
	$(BIN)/python tests/ops/native/portable.py
	$(BIN)/python -m pip install -q --no-compile -e '.[test,transformers,triton,interp-parity]'
	$(BIN)/python scripts/precompile.py
	rm -f $(VENV)/.installed-*
	touch $(STAMP) $(DEMO_STAMP)

venv: $(STAMP)

# The main job: trains the induction models (cached in out/lab-cache), analyses the
# pretrained MiniLM's sinks, decodes with the KV cache, runs the seeds' claims, prints a
# summary and writes the offline report out/report.html.
demo: $(DEMO_STAMP)
	$(BIN)/attnlab demo --out out/report.html

# Style (ruff: lint and format, a second) first; types (mypy: one process, ~25 s cold) run beside
# the tests, on the core time their two workers leave idle, and fail the command after them with
# mypy's report.  `make lint` / scripts/lint.sh run the same checks alone.  --dist worksteal: a
# worker that runs out of tests takes queued ones from the other (with the default `load`, the
# tests already sent to a worker held up on the 70 s Triton compile ran after it, one core idle:
# 80 s of a 5 min 49 s run, 2026-12-05).
test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy src/attnlab > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(BIN)/python -m pytest -n 2 --dist worksteal --durations=15; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy src/attnlab:"; cat $(VENV)/mypy.log; \
	test $$tests = 0 && test $$typed = 0

lint: $(STAMP)
	BIN=$(BIN) scripts/lint.sh

# The benchmarks, side by side with their anchors (docs/benchmarks.md).
bench: $(STAMP)
	mkdir -p out
	$(BIN)/attnlab bench attention --json out/bench-attention.json

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis .mypy_cache .ruff_cache
