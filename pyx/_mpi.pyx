# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""engine._mpi: the MPI transport (point-to-point for the engine's algorithms and the user's
send/recv) and MPI's native collectives, behind engine._core's seam."""

import sys

from libc.stdlib cimport malloc, free, realloc
from libc.limits cimport INT_MAX
from libc.stdint cimport SIZE_MAX, uint32_t

from mpi4py.libmpi cimport *
from mpi4py.MPI cimport Comm

from pthread cimport pthread_mutex_t, pthread_mutex_init, pthread_mutex_lock, pthread_mutex_unlock, pthread_mutex_destroy

from kernels cimport *
from shm cimport eng_now, eng_load32, eng_add32, eng_sub32
from schedule cimport all_equal
from engine._core cimport (RedC, WaitCtx, wait_until, Call, Req, Status, Transport, req_active, posted_tag, CoreComm,
                           IMPL_NATIVE, OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE, OP_ALLGATHER, OP_GATHER, OP_SCATTER, OP_REDUCE_SCATTER,
                           OP_ALLTOALL, OP_BARRIER, ANY_PEER, ANY_TAG_, ENG_ERR_MPI, ENG_ERR_NOMEM, ENG_ERR_OTHER_CALL,
                           ENG_ERR_PEER_DEAD, ENG_ERR_PEER_LEFT, ENG_ERR_TRUNCATE, eng_other_call)
from mpi4py import MPI as _MPI

from engine._core import EngineError, OP_KIND_NAMES, _kernel_slot

include "mpi_tables.pxi"
include "mpi_transport.pxi"
include "mpi_collectives.pxi"

eng_isa_bind(_kernel_slot())   # the kernels engine._core chose (ENGINE_ISA), not this module's own copy


def _kernel_table():
    """The address of the kernel table this module runs: engine._core's (its _kernel_table())."""
    return eng_isa_table()

_init_mpi_tables()
