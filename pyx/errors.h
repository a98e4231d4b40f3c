/* The engine's error codes: a transport's calls return 0, -1 (a Python exception is set) or one of
 * these, never an MPI library's own code (MPICH's codes are large numbers that may be any of these:
 * the MPI transport keeps its code and returns ENG_ERR_MPI). pyx/engine/_core.pxd reads them here. */
#ifndef ENGINE_ERRORS_H
#define ENGINE_ERRORS_H

#define ENG_ERR_BASE 100000
#define ENG_ERR_PEER_DEAD 100001   /* a peer process exited */
#define ENG_ERR_MISMATCH 100002    /* peers are in different collectives */
#define ENG_ERR_CORRUPT 100003     /* a peer wrote something out of bounds (the segment, the wire) */
#define ENG_ERR_TRUNCATE 100004    /* a message longer than the receive buffer */
#define ENG_ERR_NOMEM 100005
#define ENG_ERR_CMA 100007         /* a single copy from a peer's memory (process_vm_readv) failed */
#define ENG_ERR_CONNECT 100008     /* a connection to a peer could not be made (TCP) */
#define ENG_ERR_PEER_LEFT 100009   /* a peer left the group in order (TCP: its goodbye) while still needed */
#define ENG_ERR_ABORTED 100010     /* the group was aborted (CoreComm.abort): waits end, later calls are refused */
#define ENG_ERR_OTHER_CALL 100011  /* a peer's message belongs to another collective than the one waiting on it */
#define ENG_ERR_MPI 100012         /* an MPI call failed: MPI's own code is the transport's (MpiTransport.failed) */
#define ENG_ERR_PEER_TIMED_OUT 100013  /* a peer gave the group up after its call timed out, while still needed
                                          (a transport's classify(); the call timed out, in effect) */

#endif
