# Set-up and everyday targets. Every target creates .venv itself on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint typecheck bench bench-small clean venv venv-tf venv-chainer venv-peers test-frameworks \
	venv-integrations test-integrations bench-integrations

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) -q torch==2.13.0
	$(PIP) -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/snapstate demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -p no:cacheprovider

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

bench-small: $(STAMP)
	$(BIN)/python benchmarks/bench_small.py

# TensorFlow and Chainer each live in their own venv (their numpy and setuptools pins clash with
# the core one); both carry the same CPU torch because snapstate's engine is built on it.
TF_VENV := .venv-tf
TF_STAMP := $(TF_VENV)/.installed
CH_VENV := .venv-chainer
CH_STAMP := $(CH_VENV)/.installed
FW_TEST := -m pytest -q -p no:cacheprovider

venv-tf: $(TF_STAMP)

$(TF_STAMP): pyproject.toml constraints.txt
	test -x $(TF_VENV)/bin/python || $(PY) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install -q --upgrade pip
	$(TF_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0 tensorflow-cpu==2.21.0
	$(TF_VENV)/bin/python -m pip install -q -c constraints.txt -e '.[bench]' pytest pytest-timeout
	touch $(TF_STAMP)

venv-chainer: $(CH_STAMP)

# ChainerMN needs an MPI: Debian's Open MPI, installed once when mpirun is missing (CI runs as root).
$(CH_STAMP): pyproject.toml constraints.txt
	command -v mpirun >/dev/null || (apt-get update -q && apt-get install -y -q openmpi-bin libopenmpi-dev)
	test -x $(CH_VENV)/bin/python || $(PY) -m venv $(CH_VENV)
	$(CH_VENV)/bin/python -m pip install -q --upgrade pip
	$(CH_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0 'numpy<2' wheel
	# chainer's setup.py needs an old setuptools; torch declares a newer one it does not use at run time.
	$(CH_VENV)/bin/python -m pip install -q 'setuptools<70'
	$(CH_VENV)/bin/python -m pip install -q -c constraints.txt --no-build-isolation chainer==7.8.1 mpi4py 'numpy<2'
	$(CH_VENV)/bin/python -m pip install -q -c constraints.txt -e '.[bench]' pytest pytest-timeout 'numpy<2'
	# chainer imports numpy.distutils at start, which breaks under setuptools >= 70: pin it last.
	$(CH_VENV)/bin/python -m pip install -q 'setuptools<70'
	touch $(CH_STAMP)

# torchsnapshot and DLRover, the peers the harness measures, beside PyTorch 2.13 (DLRover
# brings pynvml, which makes every `import torch` warn: kept out of the core venv).
PE_VENV := .venv-peers
PE_STAMP := $(PE_VENV)/.installed

venv-peers: $(PE_STAMP)

$(PE_STAMP): pyproject.toml constraints.txt
	test -x $(PE_VENV)/bin/python || $(PY) -m venv $(PE_VENV)
	$(PE_VENV)/bin/python -m pip install -q --upgrade pip
	$(PE_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0
	$(PE_VENV)/bin/python -m pip install -q -c constraints.txt -e '.[bench,peers]' pytest pytest-timeout
	touch $(PE_STAMP)

test-frameworks: $(TF_STAMP) $(CH_STAMP) $(PE_STAMP)
	$(TF_VENV)/bin/python $(FW_TEST) tests/frameworks
	$(CH_VENV)/bin/python $(FW_TEST) tests/frameworks
	$(PE_VENV)/bin/python $(FW_TEST) tests/frameworks

# The trainers snapstate plugs into (transformers, lightning, accelerate, timm), pinned in
# constraints.txt, in their own venv so the core test run stays light.
INT_VENV := .venv-integrations
INT_STAMP := $(INT_VENV)/.installed

venv-integrations: $(INT_STAMP)

# timm needs torchvision, and PyPI's torchvision imports only beside the torch it was built for:
# this venv takes torch 2.14.1 with torchvision 0.29.1 (both on this machine's disk), the other
# pins from constraints.txt.
INT_TORCH := torch==2.14.1 torchvision==0.29.1
INT_PINS := $(INT_VENV)/constraints.txt

$(INT_STAMP): pyproject.toml constraints.txt
	test -x $(INT_VENV)/bin/python || $(PY) -m venv $(INT_VENV)
	$(INT_VENV)/bin/python -m pip install -q --upgrade pip
	grep -v -E '^(torch|torchvision)==' constraints.txt > $(INT_PINS)
	echo '$(INT_TORCH)' | tr ' ' '\n' >> $(INT_PINS)
	$(INT_VENV)/bin/python -m pip install -q -c $(INT_PINS) $(INT_TORCH)
	$(INT_VENV)/bin/python -m pip install -q -c $(INT_PINS) -e '.[dev,integrations]'
	touch $(INT_STAMP)

test-integrations: $(INT_STAMP)
	$(INT_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations

# Lightning's CheckpointIOs beside snapstate's plug-in (docs/integrations.md, "Measured")
bench-integrations: $(INT_STAMP)
	$(INT_VENV)/bin/snapstate bench --preset integrations --out bench-integrations

clean:
	rm -rf $(VENV) $(TF_VENV) $(CH_VENV) $(PE_VENV) $(INT_VENV) build dist src/*.egg-info .pytest_cache
