import os
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/

# tests/mpi/ and tests/gpu/ run under a launcher through test_mpi_suites.py, test_launchers.py and
# test_gpu_suites.py (mpirun.py / torchrun.py set ENGINE_MPI_SUITE / ENGINE_TORCHRUN_SUITE), not directly.
if not (os.environ.get("ENGINE_MPI_SUITE") or os.environ.get("ENGINE_TORCHRUN_SUITE")):
    collect_ignore = ["mpi", "gpu"]

# What launchers and torch's harnesses leave in the temporary directory (torchrun's torchelastic_* logs,
# FileStore files, Open MPI's session directories) goes into one directory per session, removed at its
# end. The engine itself writes nothing there (its segments are in /dev/shm, which the tests check).
# A pytest run inside a launched suite inherits its parent's directory and leaves it to the parent.
OWN_TMPDIR = None
SESSION_START = time.time()
if "ENGINE_TESTS_TMPDIR" not in os.environ:
    OWN_TMPDIR = os.environ["TMPDIR"] = os.environ["ENGINE_TESTS_TMPDIR"] = tempfile.mkdtemp(prefix="engine-tests-")
    tempfile.tempdir = None   # read TMPDIR again


# The pytest inside each launched rank loads no plugins from entry points: hypothesis's and anyio's
# imports take about a second of a rank's start. The suites there use hypothesis as a library only.
os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _interrupted(signum, frame):
    # The running test's processes get the signal first: a launcher (mpiexec, torchrun) passes it on to
    # its ranks in the moment subprocess.run gives it before its SIGKILL, which would orphan them.
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            continue
        for pid in children:
            try:
                os.kill(pid, signum)
            except OSError:
                pass
    raise KeyboardInterrupt(f"pytest got {signal.Signals(signum).name}")


def pytest_configure(config):
    # A session ended by SIGTERM or SIGHUP (a CI job cancelled, a terminal closed) unwinds as after ^C:
    # its processes are told, and pytest_unconfigure removes the directory.
    if OWN_TMPDIR is not None:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _interrupted)


def _open_files():
    held = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
    return held


def _remove_orphaned_hydra_topology_files():
    """MPICH's Hydra proxy writes the node's topology to /tmp/hydra_hwloc_xmlfile_* (a fixed directory,
    not TMPDIR) and holds it open while it lives, but removes it only when its job ends cleanly: a job
    ended by MPI_Abort (the launch tests' failing ranks) leaves it. Those this session made and no
    process holds any more are removed."""
    orphans = []
    for name in os.listdir("/tmp"):
        path = os.path.join("/tmp", name)
        try:
            if name.startswith("hydra_hwloc_xmlfile_") and os.lstat(path).st_mtime >= SESSION_START:
                orphans.append(path)
        except OSError:
            pass
    if orphans:
        held = _open_files()
        for path in orphans:
            if path not in held:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def pytest_unconfigure(config):
    if OWN_TMPDIR is not None:
        shutil.rmtree(OWN_TMPDIR, ignore_errors=True)
        _remove_orphaned_hydra_topology_files()

# The fast, broad checks run first: a broken kernel, algorithm or collective fails `pytest -x` within
# its first minute or two, before the slower launcher, host and fault scenarios.
FIRST = ("test_kernels.py", "test_fusion_plan.py", "test_tuning.py", "test_mpi_suites.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(FIRST)))  # stable: the rest keep order
