# Two commands do everything on a fresh machine:  `make run` (the main job)  and  `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
FMNIST_DEB := /usr/share/datasets/fashion-mnist
PRESETS ?= fafi,fedavg,ensemble,etf-anneal,flare
SEEDS ?= 1,2,3,4,5
WORKERS ?= 2
OUT ?= runs/main

.PHONY: setup data run test test-fast federation docs clean

setup: $(VENV)/.installed

# flare and the paper suite (paper/, its own distribution built on flare), both editable; -qq: errors only
$(VENV)/.installed: pyproject.toml paper/pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -qq -c constraints.txt -e '.[test,flower,sweep,baselines,zoo,docs,encoders]' -e ./paper
	@touch $@

# Fashion-MNIST from Debian's package when we can (root on Debian); otherwise say so and let the
# main job download it with torchvision into data/.
data:
	@if [ -f $(FMNIST_DEB)/train-images-idx3-ubyte.gz ]; then \
	  echo "Fashion-MNIST: found in $(FMNIST_DEB)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "Fashion-MNIST: installing the Debian package dataset-fashion-mnist"; \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null || \
	  echo "Fashion-MNIST: apt-get failed; the main job will download it with torchvision into data/"; \
	else \
	  echo "Fashion-MNIST: cannot install the Debian package (not root, or not Debian);" \
	       "the main job will download it with torchvision into data/"; \
	fi

run: setup data
	@if [ -f $(FMNIST_DEB)/train-images-idx3-ubyte.gz ]; then extra=""; \
	else echo "Fashion-MNIST: falling back to torchvision's download (dataset.root=data dataset.download=true)"; \
	     extra="dataset.root=data dataset.download=true"; fi; \
	$(BIN)/flare compare --config configs/main.yaml --presets $(PRESETS) --seeds $(SEEDS) --workers $(WORKERS) --out $(OUT) $$extra

# -n 2: two test processes, one per core (the suite's tests train with one torch thread each); worksteal: a worker
# that runs out takes queued tests from the other, so one long test near the end does not leave a core idle
test: setup data
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow" tests

# A real Flower deployment on loopback: a SuperLink and 3 SuperNodes as processes, one run, then stopped.
federation: setup data
	$(BIN)/flare federate --preset fafi --clients 3 --local-data model.name=cnn rounds=2 dataset.train_subset=2000

# The manual (mkdocs.yml) on http://127.0.0.1:8000, rebuilt as docs/, the README or the docstrings change.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test-fast: setup
	$(BIN)/python -m pytest -q -x -n 2 --dist worksteal -m "not slow" tests

clean:
	rm -rf $(VENV) runs .pytest_cache site
