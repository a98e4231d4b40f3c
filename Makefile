# make test  : create .venv, install MPI + the engine, run the whole suite (what .ci/run calls)
# make demo  : the main job: a short all_reduce sweep, engine vs Gloo vs raw MPI, 2 ranks (~30 s)
# make torch-suite : torch's own distributed test suite on the engine (gates shut and open) and on Gloo
VENV ?= .venv
PY := $(VENV)/bin/python
NRANKS ?= 2
# Open MPI refuses root without these (tests/mpirun.py adds yielding for oversubscribed runs).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup test clients-full demo ddp torch-suite clean
setup: $(VENV)/.installed

# constraints.txt pins torch for every package pip resolves or builds (a build runs in its own pip).
# Every compiled source (pyx/, its engine/ declarations) rebuilds; `make clean` drops what a build made.
$(VENV)/.installed: requirements-dev.txt requirements-clients.txt constraints.txt pyproject.toml setup.py \
		$(wildcard pyx/*.pyx pyx/*.pxi pyx/*.pxd pyx/*.h pyx/engine/*.pxd)
	test -x $(PY) || python3 -m venv $(VENV)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q -r requirements-dev.txt -r requirements-clients.txt
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

test: setup
	$(PY) -m pytest tests --durations=40

# The training libraries with Ray Train too (tests/test_clients.py; docs/clients.md). About 3 minutes.
clients-full: setup
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q -r requirements-clients-full.txt
	ENGINE_CLIENTS_FULL=1 $(PY) -m pytest tests/test_clients.py -rA

demo: setup
	$(VENV)/bin/mpiexec -n $(NRANKS) $(PY) -m bench all_reduce -b 1K -e 4M -f 4 --backends engine,gloo,mpi4py -c 1

ddp: setup
	$(VENV)/bin/mpiexec -n $(NRANKS) $(PY) examples/ddp_train.py

# torch's own distributed test suite through its spawn harness, on the engine, on the engine with the
# suite's name gates open (Gloo's set of tests), then on Gloo (the reference); WORLD_SIZE=3 as torch's
# CI. About an hour and a half on 2 cores; docs/torch-suite.md has the results.
torch-suite: setup
	BACKEND=engine WORLD_SIZE=3 $(PY) -m pytest tests/torch_suite.py -q -p no:cacheprovider -rfEs
	TORCH_SUITE_GATES=open WORLD_SIZE=3 $(PY) -m pytest tests/torch_suite.py -q -p no:cacheprovider -rfEs
	BACKEND=gloo WORLD_SIZE=3 $(PY) -m pytest tests/torch_suite.py -q -p no:cacheprovider -rfEs

clean:
	rm -rf build engine/*.so torchbridge/*.so pyx/*.c *.egg-info $(VENV)/.installed
