# ENGINE_DEBUG's signature exchange: before each collective, the ranks allgather what they are about
# to call (engine/communicator.py compares the rows). It is not numbered or recorded, and its waits
# go through the group's watch, so a rank that never arrives ends in an exception, not a hang.


def allgather_watched(CoreComm comm, sendbuf, recvbuf):
    """recvbuf = every rank's sendbuf, by the point-to-point ring, which every transport runs."""
    cdef Message ms = as_message(sendbuf, False, "sendbuf")
    cdef Message mr = as_message(recvbuf, True, "recvbuf")
    cdef int ierr = 0
    cdef WaitCtx ctx
    cdef Call c
    if mr.count != ms.count * comm.size or mr.dtype != ms.dtype:
        raise ValueError("allgather_watched: recvbuf must hold sendbuf's count x group size, same dtype")
    if comm.aborted:
        raise comm.error(ENG_ERR_ABORTED, "allgather")
    c = new_call(OP_ALLGATHER, ms.ptr, mr.ptr, ms.count, ms.dtype)
    c.impl = IMPL_RING
    c.counts = <size_t*>malloc(2 * comm.size * sizeof(size_t))   # its own: comm.cnt is the checked call's
    if c.counts == NULL:
        raise MemoryError()
    c.displs = c.counts + comm.size
    even_counts(<size_t*>c.counts, <size_t*>c.displs, comm.size, ms.count)
    comm.algo_tp.begin_call(0)      # no call's: a message of the call before is never taken for this one
    comm.start(&ctx)
    comm.busy += 1
    try:
        with nogil:
            ierr = comm.run(&c, &ctx)
        if ierr:
            comm.limbo.append((ms, mr))   # a failed ring may leave a receive posted into them
            raise comm.error(ierr, "allgather")
    finally:
        comm.call_left()
        free(<void*>c.counts)
