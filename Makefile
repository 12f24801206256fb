# Two entry points, each self-contained on a fresh machine: `make demo`, `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fastckpt-installed
# DeepSpeed JIT-compiles an op on its first init_distributed; cache it inside the venv.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
# No pip cache: CI's disk can be small (one run died of ENOSPC while installing), and a cache of
# every wheel doubles what an install writes.
export PIP_NO_CACHE_DIR := 1

.PHONY: demo test venv docs clean bench

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel on disk (an unpinned torch pulls a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# kvikio without the CUDA toolkit it asks for (about 2.5 GB of cuBLAS, cuFFT, cuSOLVER...): with no
	# GPU it can only import and say why GDS is off, which is what the tests check. A GPU machine
	# installs 'fastckpt[gds]' instead, which brings everything.
	$(BIN)/pip install -q --no-deps kvikio-cu12==26.10.0 libkvikio-cu12==26.10.0 cupy-cuda12x==14.2.0 \
		cuda-pathfinder==1.9.1 rapids-logger nvidia-cufile-cu12==1.14.1.1
	# DeepSpeed builds from source against the torch above; ops are JIT-compiled when used.
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation 'deepspeed==0.19.8'
	# Build its one JIT op (the CPU shared-memory collective every CPU init_distributed loads) now, not in a test:
	# cost the first DeepSpeed test about 55 s of CPU on every CI run (its venv is new, the cache empty).
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator; \
		get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# --durations: the slowest tests close the output (the suite must stay well inside CI's 20 minutes)
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

docs: $(STAMP)
	$(BIN)/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) site build *.egg-info src/*.egg-info
