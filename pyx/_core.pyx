# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""engine._core: the compiled core without MPI: kernels, the buffer layer, the transport seam, the
point-to-point algorithms, the communicator core, the shared-memory transport and the TCP transport."""

import array
import errno
import os
import sys
import threading

from libc.stdlib cimport malloc, calloc, realloc, free, qsort
from libc.string cimport memcmp, memcpy, memmove, memset
from libc.stdint cimport uint64_t, SIZE_MAX
from libc.math cimport INFINITY
from libc.errno cimport ECONNREFUSED, EHOSTUNREACH, EMFILE, ENFILE, ESRCH, ETIMEDOUT
from cpython.pythread cimport PyThread_get_thread_ident
from cpython.exc cimport PyErr_CheckSignals

from kernels cimport *
from pthread cimport *
from shm cimport *
from schedule cimport *
from team cimport *

include "errors.pxi"
include "exit_deadline.pxi"
include "dtypes.pxi"
include "user_ops.pxi"
include "message.pxi"
include "kernels_api.pxi"
include "wait.pxi"
include "transport.pxi"
include "schedule.pxi"
include "ring.pxi"
include "recorder.pxi"
include "request.pxi"
include "counts.pxi"
include "comm.pxi"
include "hierarchy.pxi"
include "signature_exchange.pxi"
include "shm_segment.pxi"
include "shm_transport.pxi"
include "p2p_collectives.pxi"
include "tcp_transport.pxi"
include "shm_collectives.pxi"
