# MPI error codes become Python exceptions in one place.

class EngineError(RuntimeError):
    """A communication failed inside MPI (or the engine's own schedule)."""


cdef str error_string(int ierr):
    cdef char msg[512]
    cdef int n = 0
    if MPI_Error_string(ierr, msg, &n) != 0:
        return f"MPI error {ierr}"
    return msg[:n].decode(errors="replace")


cdef int check(int ierr, str what) except -1:
    if ierr == 0:
        return 0
    if ierr == -1:
        raise MemoryError(f"{what}: out of memory")
    cdef int cls = ierr
    MPI_Error_class(ierr, &cls)
    if cls == MPI_ERR_TRUNCATE:
        raise EngineError(f"{what} failed: message truncated: a peer sent more elements than the receive "
                          "buffer holds; the buffer sizes on the ranks do not match")
    raise EngineError(f"{what} failed: {error_string(ierr)}")
