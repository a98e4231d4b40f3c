# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""engine._core: the compiled core (kernels, buffer layer, ring, MPI collectives)."""

import sys

from mpi4py.libmpi cimport *
from mpi4py.MPI cimport Comm
from kernels cimport *

include "errors.pxi"
include "dtypes.pxi"
include "message.pxi"
include "kernels_api.pxi"
include "wait.pxi"
include "ring.pxi"
include "collectives.pxi"

_init_mpi_tables()
