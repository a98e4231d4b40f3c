# make test  : create .venv (torch 2.13) and run the whole suite on it while .venv-torch2.14, .venv-torch2.15 and
#              .venv-mpich install beside it, install MPI + the engine in each, then, beside the first suite, the
#              torch-facing suites and the core suites' heaviest one-host launches on torch 2.15, the
#              version-bound part on torch 2.14, and the core suites under MPICH (what .ci/run calls)
# make check : the fast tier (about two minutes on 2 cores): kernels, schedules, registry, layout, the TCP transport,
#              and the core suites at 2 ranks under mpiexec (shared memory, MPI) and torchrun
# make demo  : the main job: a short all_reduce sweep, engine vs Gloo vs raw MPI, 2 ranks (~30 s)
# make torch-suite : torch's own distributed test suite on the engine (gates shut and open) and on Gloo
# make asan  : the engine built with AddressSanitizer in .asan/ (a copy of the tracked files), the adapter's
#              suites under torchrun and tests/mpi under mpiexec on it, 3 ranks each; the matrix over TCP,
#              and with 2 threads a rank on two forced sockets at 4 ranks; the TCP wire tests and every ISA's
#              kernels on every tail and unaligned start. Fails on any report
VENV ?= .venv
PY := $(VENV)/bin/python
# The suites that face torch, with the bench's own torch groups, run on the newest torch tested (2.15). The
# release before it (2.14) runs their part that changes with torch's version: the options' layouts,
# torch's own suite subset (every c10d call it makes through the adapter), torchft (and reconfigure:
# fault tolerance runs on every torch, in the waiting stream),
# torch.compile (with aot_eager: the same graphs without inductor's C++ build, 27 s; 2.15 runs inductor).
# (The adapter's own suites and the bench's groups run on the first and the last torch; debug mode's run of
# them, on the first only.)
TORCH_FACING := tests/test_torch_options.py tests/test_launchers.py tests/test_clients.py \
	tests/test_torch_hooks.py tests/test_recovery.py tests/test_torchft.py \
	tests/test_bench.py::test_end_to_end_under_mpiexec_and_plot \
	tests/test_bench.py::test_init_times_a_reconfigure_where_torch_has_one
TORCH_PREVIOUS := tests/test_torch_options.py \
	tests/test_launchers.py::test_torch_distributed_suite_subset_with_gates_open \
	tests/test_torch_hooks.py tests/test_torchft.py tests/test_clients.py::test_torch_compile_functional_collectives_and_compiled_ddp
# The adapter's suites under torchrun run at 3 ranks on the last torch, at 1, 2 and 4 on the first (which
# also runs them at 2 ranks under mpiexec over MPI; the last, at 3 and 4: CORE_LAST): CI's 25 minutes. The c10d
# restart and the shm cycles (held and not) run on the first only, the TCP cycles on the last only. The
# aborts of a blocked call split between the first and the last torch, each case on one (every launcher
# and transport on the last: ABORTS_FIRST runs on the first). The settings check of the group's creation
# runs on the first.
ABORTS_FIRST := torchrun-shm-thread-all_reduce torchrun-tcp-thread-all_reduce mpirun-mpi-thread-barrier
ABORTS_LAST := torchrun-shm-signal-all_reduce torchrun-tcp-thread-recv mpirun-mpi-thread-recv mpirun-shm-thread-all_reduce
TORCH_FACING_SKIP := $(foreach n,1 2 4,--deselect "tests/test_launchers.py::test_torch_suites_under_torchrun[$(n)]") \
	--deselect "tests/test_recovery.py::test_torchrun_restart_after_a_killed_rank_trains_like_one_process[c10d]" \
	--deselect "tests/test_recovery.py::test_init_destroy_and_reconfigure_cycles_keep_nothing[shm]" \
	--deselect "tests/test_recovery.py::test_init_destroy_and_reconfigure_cycles_keep_nothing[shm-held]" \
	$(foreach c,$(ABORTS_FIRST),--deselect "tests/test_recovery.py::test_abort_ends_a_call_blocked_on_a_rank_that_never_arrives[$(c)]") \
	--deselect tests/test_launchers.py::test_ranks_with_different_settings_refuse_a_torch_group_naming_the_setting \
	--deselect tests/test_launchers.py::test_torch_backend_suite_in_debug_mode_under_torchrun
# The core suites' heaviest one-host launches (3 and 4 ranks under mpiexec on both transports, 16 ranks,
# the matrix over TCP and with threads, MPI's tiny chunks and the tiny segment) run on the last torch,
# beside its torch-facing suites: on the first, whose suite is the longer stream, they kept the later
# stream idle for its last minutes. Each runs on one torch only (the parallelism suite under mpiexec
# stays on the first, which runs no other).
CORE_LAST := $(foreach c,shm-3 mpi-3 shm-4 mpi-4,"tests/test_mpi_suites.py::test_suites_under_mpiexec[$(c)]") \
	tests/test_mpi_suites.py::test_every_collective_at_16_ranks tests/test_mpi_suites.py::test_matrix_with_threads \
	tests/test_mpi_suites.py::test_matrix_over_tcp_on_one_host tests/test_mpi_suites.py::test_collectives_with_tiny_mpi_chunks \
	tests/test_mpi_suites.py::test_collectives_through_a_tiny_segment
# The fault soak runs on the first torch only (the group's own reconfigure; dist._reconfigure reaches the
# same method, and tests/test_fault_tolerance.py calls it on the later ones). Fault tolerance runs whole on
# every torch (WAITING; the first's c10d defines no reconfigure: what calls it skips there); the first
# keeps the aborts of ABORTS_FIRST, the c10d restart and the shm cycles. The clients, torch's own
# suite subset, the parallelism suite, the matrix under torchrun, the torchrun exit in flight (the first torch
# runs it under mpirun, tests/test_faults.py), DDP over mp.spawn and every collective under torchrun without
# MPI (the first runs the same collectives under torchrun in the torch suites), the TCP suite over lazy
# connections and the bench's end-to-end run run on 2.15 only (TORCH_FACING; TORCH_PREVIOUS names what
# 2.14 runs too).
WHOLE_SKIP := --deselect "tests/test_launchers.py::test_torch_suites_under_torchrun[3]" \
	--ignore=tests/test_clients.py \
	--deselect "tests/test_launchers.py::test_torch_distributed_suite_subset_with_gates_open" \
	--deselect "tests/test_launchers.py::test_torch_parallelism_under_torchrun" \
	--deselect "tests/test_launchers.py::test_matrix_over_tcp_under_torchrun" \
	--deselect "tests/test_launchers.py::test_script_ending_with_collectives_in_flight_exits_cleanly_on_every_rank" \
	--deselect "tests/test_launchers.py::test_ddp_over_mp_spawn_trains_like_one_process" \
	--deselect "tests/test_launchers.py::test_every_collective_under_torchrun_without_mpi" \
	--deselect "tests/test_launchers.py::test_tcp_suite_over_lazy_connections_under_torchrun" \
	--deselect "tests/test_bench.py::test_end_to_end_under_mpiexec_and_plot" \
	--deselect "tests/test_recovery.py::test_torchrun_restart_after_a_killed_rank_trains_like_one_process[static]" \
	--deselect "tests/test_recovery.py::test_init_destroy_and_reconfigure_cycles_keep_nothing[tcp]" \
	--deselect "tests/test_recovery.py::test_init_destroy_and_reconfigure_cycles_keep_nothing[tcp-held]" \
	$(foreach c,$(ABORTS_LAST),--deselect "tests/test_recovery.py::test_abort_ends_a_call_blocked_on_a_rank_that_never_arrives[$(c)]") \
	$(foreach t,$(CORE_LAST),--deselect $(t))
NRANKS ?= 2
# torch's store resolves the name of every address it accepts or connects to (reverse DNS: 127.0.0.1,
# seen as ::ffff:127.0.0.1, misses /etc/hosts), and where the DNS server drops a query the resolver
# waits 5 s for it: this workplace's drops some (3-4 of 60 two-rank stores here took 5 s more; gloo's
# too: docs/hosts.md). The suites wait 1 s instead (glibc's shortest); a value set outside wins.
export RES_OPTIONS ?= timeout:1
# Open MPI refuses root without these (tests/mpirun.py adds yielding for oversubscribed runs).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# The installs byte-compile nothing (uv's way; pip's took most of an install's time on 2 cores): each
# module a run imports is compiled once, on its first import, so the runs here may write bytecode.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup setup-torch2.14 setup-torch2.15 check test later-stages waiting-stages test-torch2.13 test-torch2.13-waiting test-torch2.14-waiting test-torch2.15-waiting test-torch2.14 test-torch2.15 test-mpich \
	clients-full demo ddp torch-suite asan clean
setup: $(VENV)/.installed
setup-torch2.14 setup-torch2.15: setup-torch%: .venv-torch%/.installed

# The packages install with uv, which downloads and unpacks in parallel (10-25 s an environment here,
# where pip took 2-4 minutes). uv reads no pip configuration, so pip's find-links (this machine's
# /opt/wheels, which holds torch's CPU wheel) are passed on. The constraints file pins torch for every
# package uv resolves or builds (-b: a package built from source builds in an environment of its own).
# (FIND_LINKS asks pip only when an install runs, not at every make.)
FIND_LINKS = $(foreach d,$(sort $(PIP_FIND_LINKS) $(shell python3 -m pip config get global.find-links 2>/dev/null)),--find-links $(d))
packages = $(3) $(1)/bin/python -m pip install -q uv==0.13.9 && \
	$(3) $(1)/bin/uv pip install -q --python $(1)/bin/python -c $(2) -b $(2) $(FIND_LINKS)
$(VENV)/.packages: requirements-dev.txt requirements-clients.txt constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(call packages,$(VENV),constraints.txt) -r requirements-dev.txt -r requirements-clients.txt
	touch $@

# Every compiled source (pyx/, its engine/ declarations) rebuilds; `make clean` drops what a build made.
$(VENV)/.installed: $(VENV)/.packages pyproject.toml setup.py \
		$(wildcard pyx/*.pyx pyx/*.pxi pyx/*.pxd pyx/*.h pyx/engine/*.pxd)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

# The later environments' packages install while .venv's engine builds, at the lowest priority: after
# .venv's packages, which the build waits on (begun at once, the three installs shared the machine, and
# the build began last), and beside the build, which keeps one core busy most of its time. torch 2.14.1 and 2.15.0 are CUDA
# builds of several GB from PyPI. The engine goes into each as the modules .venv built
# (ENGINE_BUILD_EXTENSIONS=0, setup.py): they import no torch, and every environment pins the same
# Open MPI and mpi4py.
.PRECIOUS: $(VENV)/.packages .venv-torch%/.packages
.venv-torch%/.packages: requirements-dev.txt requirements-clients.txt requirements-torchft.txt constraints-torch%.txt \
		| $(VENV)/.packages
	test -x .venv-torch$*/bin/python || python3 -m venv .venv-torch$*
	$(call packages,.venv-torch$*,constraints-torch$*.txt,nice -n 19) -r requirements-dev.txt -r requirements-clients.txt \
		-r requirements-torchft.txt
	touch $@

.venv-torch%/.installed: .venv-torch%/.packages $(VENV)/.installed
	ENGINE_BUILD_EXTENSIONS=0 .venv-torch$*/bin/python -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# MPICH (its mpiexec, Hydra, and its MPI under the MPI transport): .venv-mpich has the mpich wheel, and
# .mpich/ is a copy of the tracked files whose engine._mpi is built against it. Its other modules use
# no MPI: they are .venv's (setup.py's ENGINE_BUILD_EXTENSIONS=missing builds only engine._mpi).
MPICH_PY := $(CURDIR)/.venv-mpich/bin/python
# The tracked files, into a folder (.mpich/, .asan/).
COPY_TRACKED = git ls-files -z | xargs -0 cp --parents -t
.venv-mpich/.packages: requirements-mpich.txt constraints.txt | $(VENV)/.packages
	test -x $(MPICH_PY) || python3 -m venv .venv-mpich
	$(call packages,.venv-mpich,constraints.txt,nice -n 19) -r requirements-mpich.txt
	touch $@

.mpich/.installed: .venv-mpich/.packages $(VENV)/.installed
	rm -rf .mpich && mkdir .mpich && $(COPY_TRACKED) .mpich
	cp --parents engine/_core.*.so engine/_progress.*.so torchbridge/_fastpath.*.so -t .mpich
	cd .mpich && MPICC=$(CURDIR)/.venv-mpich/bin/mpicc ENGINE_BUILD_EXTENSIONS=missing \
		$(MPICH_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

CHECK := tests/test_kernels.py tests/test_schedules.py tests/test_registry.py tests/test_fusion_plan.py \
	tests/test_layout.py tests/test_settings.py tests/test_tcp_transport.py tests/test_arrival_notes.py \
	"tests/test_mpi_suites.py::test_suites_under_mpiexec[shm-2]" "tests/test_mpi_suites.py::test_suites_under_mpiexec[mpi-2]" \
	"tests/test_launchers.py::test_torch_suites_under_torchrun[2]"

check: setup
	$(PY) -m pytest $(CHECK) --durations=5

# `make test` runs two streams of suites side by side, as make jobs: the first torch's whole suite, and
# the later ones' suites with MPICH's after them, each stream's tests seeing a /dev/shm of its own
# (tests/own_shm.sh). Alone, the first torch's suite keeps two cores about two-thirds busy (its tests
# wait on timeouts, launches, a rank's peers); side by side the streams fill them. Its fault and launch
# tests slow the most beside the other stream, so that stream stays short (the namespace hosts' suite
# stays in the first). The later environments' packages (GBs of downloads,
# mostly waiting on the network) install at the lowest priority while .venv's engine builds and its
# suite starts; the engine then goes into each. Where no mount namespace can be made (not root) the
# streams run one after the other. The later stream's output is in .later-stages.log, printed at the end.
# The suites that mostly wait (on timeouts, a member that never comes, a reconfigure's deadline, a
# launch: the fault suite keeps a core about two-thirds busy, fault tolerance a sixth) run beside both
# streams, as a third, on each torch (WAITING on the first, fault tolerance on the later ones; their
# output in .waiting-stage.log, printed at the end): inside the streams their minutes left a core idle,
# and the first torch's stream ended minutes after the others.
OWN_SHM := $(shell tests/own_shm.sh --probe && echo tests/own_shm.sh)
LATER_INSTALLED := .venv-torch2.14/.installed .venv-torch2.15/.installed .mpich/.installed
WAITING := tests/test_fault_tolerance.py tests/test_arrival_notes.py tests/test_faults.py
test: $(VENV)/.packages
	$(MAKE) -k -j6 test-torch2.13 waiting-stages later-stages; rc=$$?; \
	cat .waiting-stage.log .later-stages.log 2>/dev/null; exit $$rc

later-stages: $(LATER_INSTALLED) | $(if $(OWN_SHM),,test-torch2.13 waiting-stages)
	@echo "the later torches' and MPICH's suites: their output follows the first torch's (.later-stages.log)"
	$(MAKE) -k -j1 test-torch2.14 test-torch2.15 test-mpich > .later-stages.log 2>&1

waiting-stages: setup setup-torch2.14 setup-torch2.15 | $(if $(OWN_SHM),,test-torch2.13)
	@echo "the suites that mostly wait: their output follows the first torch's (.waiting-stage.log)"
	$(MAKE) -k -j1 test-torch2.13-waiting test-torch2.14-waiting test-torch2.15-waiting > .waiting-stage.log 2>&1

test-torch2.13: setup
	$(OWN_SHM) $(PY) -m pytest tests $(WHOLE_SKIP) $(foreach f,$(WAITING),--ignore=$(f)) --durations=400

test-torch2.13-waiting: setup
	$(OWN_SHM) $(PY) -m pytest $(WAITING) --durations=10

test-torch2.14-waiting test-torch2.15-waiting: test-torch%-waiting: setup-torch%
	$(OWN_SHM) .venv-torch$*/bin/python -m pytest tests/test_fault_tolerance.py --durations=5

test-torch2.14: setup-torch2.14
	ENGINE_CLIENTS_COMPILE_BACKEND=aot_eager $(OWN_SHM) .venv-torch2.14/bin/python -m pytest $(TORCH_PREVIOUS) --durations=10

# Under MPICH's mpiexec, after checking that MPICH is what runs: the core suites at 2 ranks on MPI
# (native collectives and the engine's algorithms over MPICH's point-to-point), and the launch tests
# (the launcher's variables, failures at init ending the job, worlds made again: shared memory's
# bootstrap under hydra). Shared memory's collectives don't depend on the MPI that bootstrapped them:
# their suites run under Open MPI's mpiexec and torchrun.
test-mpich: .mpich/.installed
	$(COPY_TRACKED) .mpich   # (this tree's edits since the copy was built)
	cd .mpich && $(MPICH_PY) -c "from mpi4py import MPI; v = MPI.Get_library_version(); assert 'MPICH' in v, v"
	cd .mpich && $(OWN_SHM:tests/%=$(CURDIR)/tests/%) $(MPICH_PY) -m pytest -q -p no:cacheprovider "tests/test_mpi_suites.py::test_suites_under_mpiexec[mpi-2]" \
		"tests/test_mpi_suites.py::test_receives_from_any_rank_over_mpi" tests/test_launch.py --durations=5 \
		$(foreach c,torchrun-under-srun spawn-under-srun,--deselect "tests/test_launch.py::test_worlds_beside_an_mpi_launchers_job_and_made_again[$(c)]")

test-torch2.15: setup-torch2.15
	$(OWN_SHM) .venv-torch2.15/bin/python -m pytest $(TORCH_FACING) $(CORE_LAST) $(TORCH_FACING_SKIP) \
		--durations=20

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

# libstdc++ is preloaded beside the sanitizer's runtime so that its interceptor finds __cxa_throw (torch's
# libraries throw C++ exceptions while they load).
ASAN_PRELOAD = $(shell gcc -print-file-name=libasan.so) $(shell gcc -print-file-name=libstdc++.so.6)
ASAN_RUN = LD_PRELOAD="$(ASAN_PRELOAD)" ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:allocator_may_return_null=1:log_path=$(CURDIR)/.asan/report

asan: setup
	rm -rf .asan && mkdir .asan && $(COPY_TRACKED) .asan
	cd .asan && CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g" LDFLAGS="-fsanitize=address" \
		$(CURDIR)/$(PY) setup.py -q build_ext --inplace
	cd .asan && $(ASAN_RUN) $(CURDIR)/$(PY) tests/torchrun.py 3 tests/mpi/test_torch_backend.py \
		tests/mpi/test_torch_training.py tests/mpi/test_torch_observability.py tests/mpi/test_matrix.py
	cd .asan && $(ASAN_RUN) $(CURDIR)/$(PY) tests/mpirun.py 3 tests/mpi --ignore=tests/mpi/test_matrix.py
	cd .asan && $(ASAN_RUN) ENGINE_TRANSPORT=tcp $(CURDIR)/$(PY) tests/mpirun.py 3 tests/mpi/test_matrix.py \
		tests/mpi/test_collectives.py
	cd .asan && $(ASAN_RUN) ENGINE_THREADS=2 ENGINE_SOCKETS=2 $(CURDIR)/$(PY) tests/mpirun.py 4 tests/mpi/test_matrix.py \
		tests/mpi/test_collectives.py
	cd .asan && $(ASAN_RUN) $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider tests/test_tcp_transport.py tests/test_shm_queues.py tests/test_kernels.py
	@# A size read from the wire past what malloc can give is refused and fails that peer (the TCP fuzz claims
	@# ENG_TCP_MAX_MESSAGE, 1 << 48): allocator_may_return_null makes that a warning line. Any other line in a
	@# report fails the run.
	@if ls .asan/report.* >/dev/null 2>&1; then cat .asan/report.*; \
		if grep -h -v -E '^==[0-9]+==WARNING: AddressSanitizer failed to allocate 0x1000000000000 bytes$$|^$$' \
			.asan/report.* | grep -q .; then exit 1; fi; echo "asan: only refused allocations (handled)"; fi

clean:
	rm -rf build .asan .mpich engine/*.so torchbridge/*.so pyx/*.c *.egg-info $(VENV)/.installed $(VENV)/.packages .venv-torch*/.installed .venv-torch*/.packages \
		.venv-mpich/.packages .later-stages.log .waiting-stage.log
