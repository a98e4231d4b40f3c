# Declarations of engine._core: what engine._mpi takes from it (it subclasses Transport and CoreComm),
# and what one of _core's files takes from another. The files _core.pyx includes take nothing from each
# other that is not declared here, so their include order carries no meaning (tests/test_layout.py
# compiles them in reverse order).
#
# Layers, each calling only the one below:
#   CoreComm (parse buffers, check, record, choose)  ->  algorithms (ring, recursive doubling, the
#   shared-memory collectives)  ->  Transport (post / test / wait / cancel of byte messages)  ->  kernels.

from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport realloc
from libc.string cimport memset
from cpython.buffer cimport Py_buffer

from kernels cimport eng_reduce_fn


# ---- buffers ----

cdef extern from "dlpack.h":
    ctypedef struct DLDevice:
        int device_type
    ctypedef struct DLDataType:
        unsigned char code
        unsigned char bits
        unsigned short lanes
    ctypedef struct DLTensor:
        void *data
        DLDevice device
        int ndim
        DLDataType dtype
        long long *shape
        long long *strides
        unsigned long long byte_offset
    ctypedef struct DLManagedTensor:
        DLTensor dl_tensor
        void (*deleter)(DLManagedTensor *)
    enum: kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLComplex, kDLBool, kDLCPU, kDLCUDAHost
    enum: kDLFloat8_e4m3fn, kDLFloat8_e4m3fnuz, kDLFloat8_e5m2, kDLFloat8_e5m2fnuz, kDLFloat8_e8m0fnu, kDLFloat4_e2m1fn


cdef class Message:
    cdef void *ptr
    cdef size_t count
    cdef int dtype
    cdef size_t itemsize
    cdef object owner
    cdef Py_buffer view
    cdef bint has_view
    cdef DLManagedTensor *managed


cdef Message as_message(object obj, bint writable, str role)
cdef Message apart(Message ms, Message mr, const char *in_place)
cdef int same_dtype(Message a, Message b, str what) except -1


# ---- reductions ----

cdef struct RedC:
    eng_reduce_fn fn    # the engine kernel for (op, dtype)
    int code            # ENG_SUM..ENG_BXOR; -1 for a user op
    int dtype
    bint avg            # SUM, then divide by the group size
    uint32_t ident      # a user op's fingerprint (engine.UserOp.fingerprint); 0 for the built-in ops


cdef class Reduction:
    cdef RedC c
    cdef object keep    # a user op's compiled code, kept alive


cdef Reduction resolve_op(object op, int dtype)


# ---- waiting ----

ctypedef int (*alive_fn)(void *arg) noexcept nogil
ctypedef int (*side_fn)(void *arg) noexcept nogil


cdef struct WaitCtx:
    void *hook          # a Python callable hook(elapsed_seconds) (borrowed), or NULL
    double start        # when the operation began
    double interval     # seconds between hook calls
    double next_check
    alive_fn alive      # returns an engine error code once a peer is gone; NULL: no check
    void *alive_arg
    double spin         # seconds to spin before yielding; < 0: the process's policy
    uint32_t *abort     # non-zero once the group is aborted: the wait ends with ENG_ERR_ABORTED; NULL: none
    bint busy_poll      # the transport moves data only inside poll (MPI's collectives): yield, never sleep
    side_fn side        # moves another channel's messages while this wait lasts (returns whether it must be
    void *side_arg      # called again soon); NULL: none. CoreComm.start: the user's channel (Transport.nudge)


ctypedef void (*doze_fn)(void *obj, uint32_t seq, double seconds) noexcept nogil


cdef struct Doorbell:
    uint32_t *bell      # a counter whoever publishes something bumps (shared memory: a futex word it rings)
    uint32_t *asleep    # how many of this rank's threads sleep on it (shared memory), or NULL
    doze_fn doze        # the transport's own sleep until bell moves (TCP: poll on its sockets), or NULL: the futex
    void *doze_obj


ctypedef int (*poll_fn)(void *obj, void *arg, bint *done) except -1 nogil

cdef int wait_until(poll_fn poll, void *obj, void *arg, WaitCtx *ctx, Doorbell *door) except -1 nogil
cdef void start_wait(WaitCtx *ctx, object hook, double interval) noexcept
cdef double spin_budget(double group_spin) noexcept nogil   # seconds a wait on this thread spins first


# ---- errors: transports return 0, -1 (a Python exception is set) or a positive code ----

cdef extern from "call_tags.h" nogil:   # what a collective adds to its tags, and what a message's tag shows
    int eng_call_tag_base(uint64_t call_hash, uint64_t seq, int wide)
    int eng_other_call(int running, int tag)


cdef extern from "errors.h":   # the one list, each code's meaning there, shared with the C transports
    enum: ENG_ERR_BASE, ENG_ERR_PEER_DEAD, ENG_ERR_MISMATCH, ENG_ERR_CORRUPT, ENG_ERR_TRUNCATE, ENG_ERR_NOMEM, \
          ENG_ERR_CMA, ENG_ERR_CONNECT, ENG_ERR_PEER_LEFT, ENG_ERR_ABORTED, ENG_ERR_OTHER_CALL, \
          ENG_ERR_MPI, ENG_ERR_PEER_TIMED_OUT


# ---- the transport seam ----

cdef enum:
    ANY_PEER = -1
    ANY_TAG_ = -1


ctypedef struct Req:
    size_t w[4]         # transport-owned state of one posted send or receive (all zero: none)


ctypedef struct Status:
    int source
    int tag
    size_t nbytes


cdef class Transport:
    cdef readonly int rank, size
    cdef int err_peer   # the rank an engine error code names, or -1
    cdef Doorbell *door # where its waits sleep (shared memory), or NULL (naps)
    cdef int tag_base   # added to every tag posted: the running collective's (CoreComm.invoke); 0 for the user's
    cdef bint wide_tags # its tags have 31 bits, room for the call's number (pyx/call_tags.h)
    cdef uint32_t waiting   # threads waiting on a message of its now (Request.wait: drive_transport)
    cdef int isend(self, const void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil
    cdef int irecv(self, void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil
    cdef int test(self, Req *req, bint *done, Status *st) except -1 nogil
    cdef int cancel(self, Req *req) noexcept nogil
    cdef int wait(self, Req *req, Status *st, WaitCtx *ctx) except -1 nogil
    cdef void cancel_all(self, Req *reqs, size_t n) noexcept nogil
    cdef int mismatch(self, int peer) noexcept nogil
    cdef void begin_call(self, int base) noexcept nogil
    cdef int nudge(self) noexcept nogil
    cdef int in_flight(self) noexcept nogil
    cdef void group_broke(self, bint timed_out, int lost=*, bint between=*) noexcept
    cdef int lost_rank(self, int code) noexcept
    cdef tuple whole    # a stage of a hierarchy: each rank's rank in the group it serves (serve()), or None
    cdef int whole_size # that group's size
    cdef str whole_name # and name
    cdef int serve(self, tuple whole, int whole_size, str name) except -1
    cdef int in_whole(self, int w) noexcept
    cdef int whole_rank(self, int q)
    cdef int member(self, int w)
    cdef str who(self, int peer)
    cdef str whole_who(self, int w)
    cdef void release(self) noexcept
    cdef object error_text(self, int code)
    cdef int classify(self, int code) noexcept


cdef inline bint req_active(const Req *r) noexcept nogil:
    return r.w[0] != 0


cdef inline int posted_tag(Transport tp, int tag) noexcept nogil:
    """The tag a transport posts: the running collective's tag base added (ANY_TAG stays)."""
    return tag + tp.tag_base if tag >= 0 else tag


# ---- algorithms over a transport ----

cdef class RingAllreduce:
    cdef Transport tp
    cdef int rank, size
    cdef readonly size_t seg_bytes
    cdef char *tmp
    cdef Req *rreqs
    cdef Req *sreqs
    cdef size_t sreq_cap
    cdef size_t *rbase
    cdef size_t *sbase
    cdef int run(self, const char *src, char *dst, size_t count, size_t isz, eng_reduce_fn fn,
                 WaitCtx *ctx) except -1 nogil


cdef class RecursiveDoubling:
    cdef Transport tp
    cdef int rank, size
    cdef char *tmp
    cdef size_t tmp_cap
    cdef int run(self, const char *src, char *dst, size_t count, size_t isz, eng_reduce_fn fn,
                 WaitCtx *ctx) except -1 nogil


cdef int peer_exchange(Transport tp, const void *sbuf, size_t sn, int to, void *rbuf, size_t rn, int frm,
                       int tag, WaitCtx *ctx) except -1 nogil     # transport.pxi: every algorithm's exchange


# ---- the communicator core ----

# What a registry entry (engine/registry.py) runs: the core's implementations. The registry names
# the entries; the core knows only these codes and the entry index it records.
cdef enum:
    IMPL_NATIVE = 0         # the transport's own collective (MPI's), or its only way (a barrier on flags)
    IMPL_RING = 1           # the ring over the transport's point-to-point
    IMPL_RDOUBLE = 2        # recursive doubling over the transport's point-to-point
    IMPL_ONESHOT = 3        # shared memory: every rank's input in its slot, one rank (or all) reduces all
    IMPL_TWOSHOT = 4        # shared memory: reduce-scatter through the slots, then gather the blocks
    IMPL_SEGMENT = 5        # shared memory: data moves through the slots (two copies)
    IMPL_SINGLE_COPY = 6    # shared memory: data moves by one process_vm_readv from its owner's buffer
    IMPL_COMPOSITE = 7      # composed of two other groups' collectives: the hierarchy (hierarchy.pxi)
    IMPL_TREE = 8           # point-to-point: a binomial tree (broadcast, reduce)
    IMPL_PIPELINE = 9       # point-to-point: a chain from the root, in segments (broadcast)
    IMPL_RSAG = 10          # point-to-point: ring reduce-scatter, then the root gathers the blocks (reduce)
    IMPL_LINEAR = 11        # point-to-point: the root with every rank directly (gather, scatter)
    IMPL_PAIRWISE = 12      # point-to-point: every pair directly (alltoall)
    IMPL_DISSEMINATION = 13 # point-to-point: log2(P) rounds of empty messages (barrier)
    IMPL_THREADED = 14      # shared memory: two-shot, each step's copies and reduction split over the rank's threads
    NIMPLS = 15


cdef enum:
    OP_ALLREDUCE = 0
    OP_BROADCAST = 1
    OP_REDUCE = 2
    OP_ALLGATHER = 3
    OP_GATHER = 4
    OP_SCATTER = 5
    OP_REDUCE_SCATTER = 6
    OP_ALLTOALL = 7
    OP_BARRIER = 8
    OP_SENDRECV = 9     # point-to-point: never recorded; its rules choose how a message moves
    NOPKINDS = 10


cdef enum:
    OPBIT_USER = 8      # Rule.ops bits 0..7: ENG_SUM..ENG_BXOR, AVG; 8: a user op; 9: no reduction
    OPBIT_NONE = 9
    OPMARK_USER = 16    # op_mark(): a user op's mark in a call word, from here to 255


cdef inline int opbit_of(RedC *red) noexcept nogil:
    """The Rule.ops bit of a resolved reduction (OPBIT_*: op codes, AVG, a user op)."""
    if red.code < 0:
        return OPBIT_USER
    return 7 if red.avg else red.code


cdef inline int op_mark(RedC *red) noexcept nogil:
    """The reduce op in a call word: its Rule.ops bit, or for a user op OPMARK_USER + its fingerprint modulo
    256 - OPMARK_USER, so that ranks passing different user ops call different collectives."""
    if red.code < 0:
        return OPMARK_USER + <int>(red.ident % (256 - OPMARK_USER))
    return opbit_of(red)


cdef inline uint64_t call_word(int op, int dtype, int opmark, int impl, int root) noexcept nogil:
    """A collective in one word: op, dtype + 1, the reduce op's op_mark(), impl + 1, root + 1 (-1:
    none). The segment's signatures carry it; with impl -1, what every rank's call must agree on
    (recorder.pxi call_key(), the tags' hash and the flight record's key). call_word_parts() reads it."""
    return (<uint64_t>(op & 0xff) | (<uint64_t>((dtype + 1) & 0xff) << 8) | (<uint64_t>(opmark & 0xff) << 16)
            | (<uint64_t>((impl + 1) & 0xff) << 24) | (<uint64_t><uint32_t>(root + 1) << 32))


cdef struct OpRec:
    uint64_t seq
    int op
    int dtype           # -1: none
    size_t count
    int entry           # the registry entry that ran (engine.registry.ENTRIES index); -1: none
    int state           # 0 running, 1 done, 2 failed, 3 timed out
    bint native         # blocks inside the transport's own collective (no watch while it runs)
    double start, end
    uint64_t key        # what every rank's call must agree on (recorder.pxi call_key(); the watch compares)


cdef class Recorder:
    cdef OpRec *recs
    cdef size_t nrecs
    cdef readonly uint64_t seq
    cdef OpRec *cur
    cdef public object broken   # why the group is unusable, or None
    cdef public object broken_after   # what broke it, in a few words ("an earlier call timed out"), or None
    cdef object tracer          # called with each finished record (ENGINE_TRACE), or None
    cdef object on_failure      # called with (record, exception) when an operation fails
    cdef tuple entry_names      # the registry's entry names, as the rules index them (Plan.configure)
    cdef tuple record(self, OpRec *r)
    cdef object entry_name(self, int entry)
    cdef int check_usable(self, str what) except -1
    cdef OpRec *begin(self, int op, size_t count, int dtype, int entry, bint native, uint64_t key) except NULL
    cdef int end(self, OpRec *rec, object exc) except -1


cdef struct Rule:
    int entry           # the registry entry (what the flight recorder names)
    int impl            # what runs it (IMPL_*)
    size_t lo, hi       # message bytes (one rank's piece), inclusive
    int min_ranks, max_ranks
    unsigned dtypes     # bit d: takes dtype d
    unsigned ops        # bit o: takes reduce op o (OPBIT_*)
    bint uneven         # takes per-rank counts


# counts.pxi: the v-collectives' count tables, CoreComm's and the CUDA communicator's
cdef size_t v_sizes(int size, int rank, object counts, size_t mine, str mine_role, Py_ssize_t whole,
                    str whole_role, str what, size_t *out, size_t *displs) except? 0
cdef int alltoall_sizes(int size, int rank, send_counts, size_t scount, recv_counts, size_t rcount, size_t *sc,
                        size_t *sd, size_t *rc, size_t *rd) except -1

cdef struct Call:     # one collective call, as the core hands it to its transport (CoreComm.dispatch)
    int op              # OP_*
    char *src
    char *dst
    size_t count        # this rank's elements: the buffer, or its piece of a v-collective
    int dtype
    RedC *red
    int root
    int impl
    const size_t *counts    # per-rank counts and displacements (v-collectives, even ones too; alltoall: its sends)
    const size_t *displs
    const size_t *rcounts   # alltoall's receives
    const size_t *rdispls
    bint even               # alltoall: equal blocks
    void *aux               # a transport's own description of the call (shared memory's fused path)


# dtypes.pxi: AVG's divisions, before and after the sum (CoreComm.dispatch and its hierarchy's calls)
cdef double avg_before(Call *c, int rank, int size, void **spare, size_t *spare_cap) except -1 nogil
cdef void avg_after(Call *c, int size, double spread) noexcept nogil


cdef inline Call new_call(int op, const void *src, void *dst, size_t count, int dtype) noexcept nogil:
    cdef Call c
    memset(&c, 0, sizeof(c))
    c.op, c.src, c.dst, c.count, c.dtype = op, <char*>src, <char*>dst, count, dtype
    return c


# ---- the point-to-point collectives (p2p_collectives.pxi): every CoreComm runs them over its algo_tp ----

cdef class P2PCollectives:
    cdef Transport tp
    cdef int rank, size
    cdef size_t seg_bytes       # the pipelined broadcast's segment
    cdef Req *reqs              # grown, never shrunk
    cdef size_t *expect         # the bytes each posted receive must bring (SIZE_MAX: a send)
    cdef size_t cap
    cdef size_t *blocks         # 2 x size: counts and displacements of a large reduce's blocks
    cdef char *work             # workspace (grown, never shrunk)
    cdef size_t work_cap
    cdef int run(self, Call *c, WaitCtx *ctx) except -1 nogil


# The implementations P2PCollectives runs (and the ring, for every collective but allreduce).
cdef enum:
    P2P_IMPLS = ((1u << IMPL_TREE) | (1u << IMPL_PIPELINE) | (1u << IMPL_RSAG) | (1u << IMPL_LINEAR)
                 | (1u << IMPL_PAIRWISE) | (1u << IMPL_DISSEMINATION))


cdef class Hierarchy


cdef class CoreComm:
    cdef object __weakref__     # engine/transports.py leaves through the live ones at exit
    cdef readonly int rank, size
    cdef readonly str transport
    cdef Transport algo_tp      # the engine's algorithms' point-to-point
    cdef Transport user_tp      # the user's send / recv (kept apart: ANY_TAG never sees ring traffic)
    cdef Transport side_tp      # the user's channel its waits move: user_tp, or a hierarchy stage's group's
    cdef RingAllreduce ring
    cdef RecursiveDoubling rdouble
    cdef P2PCollectives p2p     # every other collective over algo_tp (trees, pipelines, rings, pairwise)
    cdef Recorder log
    cdef object hook
    cdef double spin            # this group's spin budget (seconds; < 0: the process's policy)
    cdef readonly object p2p_watch   # names the peer when a point-to-point wait times out
    cdef double interval
    cdef alive_fn alive
    cdef void *alive_arg
    cdef size_t *cnt            # 4 x size: counts and displacements of the v-collectives
    cdef Rule *rules[NOPKINDS]  # per collective, walked in order: the first that applies runs
    cdef int nrules[NOPKINDS]
    cdef Rule *named[NOPKINDS]  # per collective, every entry this group can run (the algorithm= argument)
    cdef dict named_index       # (collective, entry name) -> index into named[collective]
    cdef unsigned impls         # bit mask of the IMPL_* this transport implements
    cdef unsigned avg_fused     # the IMPL_* that divide AVG inside their reduction (dispatch divides the rest)
    cdef bint reduce_scatters_in_place   # takes a reduce_scatter whose output is its block of the input (MPI's
                                         # in-place form puts it elsewhere, and its buffers must not alias)
    cdef void *avg_input        # AVG's divided copy of an input its call leaves unchanged (avg_before)
    cdef size_t avg_input_bytes
    cdef Hierarchy hier         # runs the IMPL_COMPOSITE entries (None: the group has one level)
    cdef list limbo             # buffers of requests left posted by a failed operation
    cdef list detached          # the user's messages whose Work was dropped in flight: they still go (request.pxi)
    cdef uint32_t aborted       # set by abort() from any thread; every wait of this group reads it
    cdef int busy               # calls of this group inside the core now (abort's release waits for none)
    cdef unsigned long collective_thread   # the thread running a collective of this group now, or 0
    cdef readonly bint released # release() freed its transports: every call is refused
    cdef bint destroyed         # released without abort() first: calls are refused as destroyed, not aborted
    cdef bint release_due       # release() came while a call was inside: the last one out frees
    cdef readonly str orphaned  # this process is a fork of the one that made the group: why (orphan())
    cdef public str stage_note  # a stage of a hierarchy: its ranks in the whole group, added to every error
                                # that names its ranks (serve(); None: not a stage)
    cdef readonly int broke_over    # the rank (Transport.serve's numbering) whose loss broke the group, or -1

    cdef int init_core(self, Transport algo_tp, Transport user_tp, size_t ring_segment_bytes) except -1
    cdef void release_transports(self) noexcept
    cdef void release_if_idle(self) noexcept
    cdef void call_left(self) noexcept
    cdef void start(self, WaitCtx *ctx) noexcept
    cdef const Rule *choose(self, int op, size_t nbytes, int dtype, int opbit, bint uneven) noexcept nogil
    cdef const Rule *select(self, int op, size_t nbytes, int dtype, int opbit, bint uneven, object name) except NULL
    cdef bint single_copy(self, int op, size_t nbytes, int dtype) noexcept nogil
    cdef int invoke(self, Call *c, const Rule *rule, size_t recorded, object keep, Reduction red=*) except -1
    cdef int _invoke(self, Call *c, const Rule *rule, size_t recorded, object keep) except -1
    cdef int dispatch(self, Call *c, WaitCtx *ctx) except -1 nogil
    cdef int run(self, Call *c, WaitCtx *ctx) except -1 nogil
    cdef int run_alone(self, Call *c) except -1 nogil
    cdef bint blocks(self, Call *c) noexcept nogil     # a native call blocks in the transport: the watchdog covers it
    cdef object error(self, int ierr, str what, Transport tp=*)
    cdef object broke(self, kind, str text, str what, int lost=*)
    cdef size_t max_count(self, int op) noexcept


# a CoreComm call's checks (counts.pxi)
cdef object _index(object value, str call, str what)
cdef int _check_root(CoreComm self, object root) except -1
cdef int _check_fits(CoreComm self, int op, size_t n, str what) except -1
cdef size_t _call_sizes(CoreComm self, Call *c, object counts, Message mine, str mine_role, Message whole,
                        str whole_role, str what) except? 0
cdef Rule *_rule_array(CoreComm self, list rules) except? NULL
cdef _rooted(CoreComm self, int op, sendbuf, recvbuf, object root_, counts)
cdef object _refused(CoreComm self, int op, uint64_t seq, object exc)


cdef class Hierarchy:    # hierarchy.pxi; comm.pxi runs the composite entries through it
    cdef CoreComm local         # this host's (socket's) ranks, shared memory
    cdef CoreComm cross         # the ranks of this local index on every host
    cdef CoreComm leaders       # local index 0 of every host (None elsewhere): the leader allreduce
    cdef int hosts, per_host
    cdef int *host_of           # per global rank
    cdef int *local_of
    cdef int *place             # place[h * per_host + i]: the global rank at host h, local index i
    cdef frozenset leader_entries   # the entries that run the leader allreduce
    cdef char *work             # the workspace, grown; dropped (never freed) after a failed stage
    cdef size_t work_bytes

    cdef int run(self, Call *c, int entry, object keep) except -1
    cdef char *workspace(self, size_t nbytes) except NULL
    cdef int stage(self, CoreComm g, int op, const char *src, char *dst, size_t count, int dtype, RedC *red,
                   int root, object keep, bint blocks=*) except -1


# ---- taken by one file from another (each defined in the file its comment names) ----

cdef str _engine_error_text(int code, int peer, str who=*)     # transport.pxi
cdef int nudge_transport(void *tp) noexcept nogil   # transport.pxi: a WaitCtx's side (CoreComm.start)
cdef int drive_transport(void *tp, double seconds) noexcept nogil   # transport.pxi: CoreComm.driver's
cdef struct RaiseWatch:       # a call's view of its user op's raises (user_ops.pxi)
    bint on                   # the call runs a user op (else nothing is watched)
    bint raised               # (raise_watch_end's verdict) one of its kernels raised
    uint64_t own              # counted in this call's kernels, by its thread and its team's helpers
    uint64_t unowned          # raises no call owned, counted when the call began
    uint64_t *outer           # the thread's counter before this call's (put back at its end)
cdef void raise_watch_begin(RaiseWatch *w, bint on) noexcept nogil                    # user_ops.pxi
cdef void raise_watch_end(RaiseWatch *w) noexcept nogil                               # user_ops.pxi
cdef int user_op_check(Reduction red, bint raised, str what) except -1                 # user_ops.pxi
cdef int user_op_agree(CoreComm comm, Reduction red, bint raised, str what) except -1  # user_ops.pxi
cdef tuple call_word_parts(uint64_t w)              # recorder.pxi
cdef uint64_t call_key(const Call *c) noexcept nogil  # recorder.pxi
cdef void forget_resolved_ops() noexcept            # dtypes.pxi


cdef struct Peers:
    int n
    int self_rank
    int *pids
    int *pidfds
    char *ctrl          # the segment's control area: each rank's left word (a rank that left the group)
    int dead            # the first rank found dead, or gone from the group, or -1


cdef struct PeerWatch:      # a message's liveness check: its peer among the group's
    Peers *peers
    int peer


cdef class Request:      # request.pxi; comm.pxi posts them
    cdef Req req
    cdef Message msg
    cdef Transport tp
    cdef CoreComm comm
    cdef Status st
    cdef bint done, is_recv
    cdef bint whole         # a receive its message must fill (torch's recv: no count says what a shorter one left)
    cdef int peer, tag
    cdef str what
    cdef WaitCtx ctx
    cdef PeerWatch watch    # its ctx.alive's argument where the group checks its peers (shared memory)
    cdef double deadline    # the running wait's own end (Work.wait(timeout)); 0: the group's timeout only
    cdef double limit       # that wait's timeout, in seconds
    cdef object error       # how it failed, once spent by the failure: every later test() and wait() raises it

cdef Request post_request(CoreComm comm, Transport tp, object buf, int peer, int tag, bint recv, str what)
cdef Request whole_message(Request r, bint whole)


cdef class _PartList:    # kernels_api.pxi; the fused path of shm_collectives.pxi parses its parts with it
    cdef list messages
    cdef void **ptrs
    cdef size_t *counts
    cdef size_t n, total, largest   # largest: the largest part's count
    cdef int dtype                  # -1: the parts mix dtypes (or there are none)

cdef _PartList _parse_parts(object parts, bint writable, str role, bint one_dtype=*)


# ---- the shared segment (shm_segment.pxi) ----

cdef enum:
    LINE = 64
    HEADER_BYTES = 4096
    CTRL_BYTES = 4 * LINE
    PAGE = 4096
    SIGW = 6                    # signature words: op/dtype/redop/algo/root, count, counts hash, seq, aux, -
    SIG_COMPARED = 4            # the first four must agree across ranks (aux carries per-rank data)
    PHASE_POSTED = 1
    PHASE_REDUCED = 2
    PHASE_FINISHED = 3
    NCHANNELS = 2               # point-to-point channels: the engine's algorithms, the user's send/recv
    LEFT_AT_EXIT = 1            # a rank's left word: its process ended (its messages in flight still go),
    LEFT_WITHDRAWN = 2          # or it freed or aborted the group (its messages withdrawn, the buffers its own)
    GAVE_UP_BROKEN = 1          # a rank's gave-up word: its group broke there or it aborted it (every wait fails),
    GAVE_UP_TIMED_OUT = 2       # or a call timed out there (only the waits that still need it fail)
    GAVE_UP_FOLLOWED = 3        # or it broke there after another rank's word said that rank broke (above: its + 1)
    GAVE_UP_KIND = 0xff         # (the word's low byte; above it, GAVE_UP_BROKEN's lost rank + 1 where one broke it)



cdef int peers_alive(void *arg) noexcept nogil     # shm_segment.pxi: a WaitCtx's alive (Peers)
cdef int peer_alive(void *arg) noexcept nogil      # the same for one peer's message (PeerWatch)
cdef Transport shm_channel(ShmSegment seg, int channel)   # shm_transport.pxi


cdef inline size_t _align(size_t n, size_t a) noexcept nogil:
    return (n + a - 1) // a * a


cdef inline int grow(void **buf, size_t *cap, size_t need, size_t unit, const char *what) except -1 nogil:
    """Makes *buf hold at least `need` items of `unit` bytes (a workspace kept between calls)."""
    cdef void *bigger
    if need > cap[0]:
        bigger = realloc(buf[0], need * unit)
        if bigger == NULL:
            with gil:
                raise MemoryError(f"{what.decode()}: out of memory for {need * unit} bytes of workspace")
        buf[0], cap[0] = bigger, need
    return 0


cdef struct SegHeader:      # the segment's first bytes (shm_segment.pxi): every field a uint64_t, no padding
    uint64_t magic
    uint64_t token[2]
    uint64_t nranks
    uint64_t half_bytes
    uint64_t queue_bytes
    uint64_t nchannels
    uint64_t total
    uint64_t ctrl_off
    uint64_t index_off
    uint64_t slots_off
    uint64_t queues_off


cdef class ShmSegment:     # shm_segment.pxi; its step protocol serves shm_transport.pxi and shm_collectives.pxi
    cdef char *base
    cdef size_t total
    cdef readonly int rank, size
    cdef int fd
    cdef bint private       # a group of one: plain memory, nothing shared
    cdef readonly size_t half_bytes, table_bytes, cap, queue_bytes
    cdef size_t slot_stride
    cdef char *ctrl
    cdef char *index
    cdef char *slots
    cdef char *queues
    cdef uint64_t step
    cdef Peers peers
    cdef uint64_t my_sig[SIGW]
    cdef uint64_t err_sig[SIGW]
    cdef int err_peer
    cdef bint err_pieces            # the mismatch an error names is of a piece's size (aux: the two sizes)
    cdef bint err_peer_passed       # the peer an error names had reached the flag waited for (its part done)
    cdef int err_awaited            # with it: another peer the failed wait still waited for, or -1
    cdef int followed               # the rank (the whole group's) whose gave-up word this rank's follows, or -1
    cdef uint64_t awaited_target    # the flag wait in progress: its target (0: none), and its one peer or -1
    cdef int awaited_only
    cdef readonly bytes token
    cdef readonly bint cma          # process_vm_readv works between every pair of the group
    cdef readonly size_t cma_min, cma_max
    cdef readonly uint64_t single_copy_sends   # point-to-point messages this rank offered by single copy
    cdef Doorbell door              # this rank's: its waits sleep on it, publishers ring it
    cdef int _setup(self, const SegHeader *h, int rank, int size) except -1
    cdef void release(self) noexcept
    cdef inline bint use_cma(self, size_t nbytes) noexcept nogil
    cdef int cma_copy(self, int q, void *local, uint64_t remote, size_t n, bint write, bint collective) noexcept nogil
    cdef bint took_back(self, int q, bint collective) noexcept nogil
    cdef int write_tail(self, int q, uint64_t step, char *src, size_t at, size_t nbytes) noexcept nogil
    cdef void withdraw_buffer(self, int root, uint64_t step, uint64_t buf) noexcept nogil
    cdef bint tail_written(self, uint64_t step) noexcept nogil
    cdef void give_up(self, bint timed_out, int lost) noexcept nogil
    cdef inline uint64_t *sig(self, int r, uint64_t step) noexcept nogil
    cdef inline char *half(self, int r, uint64_t step) noexcept nogil
    cdef inline uint64_t *table(self, int r, uint64_t step) noexcept nogil
    cdef int begin(self, uint64_t w0, uint64_t count, uint64_t chash, uint64_t seq, uint64_t aux,
                   WaitCtx *ctx) except -1 nogil
    cdef inline void post(self, int phase) noexcept nogil
    cdef inline uint32_t *bell(self, int r) noexcept nogil
    cdef inline uint32_t *asleep(self, int r) noexcept nogil
    cdef inline uint32_t *left(self, int r) noexcept nogil
    cdef inline uint32_t *gave_up(self, int r) noexcept nogil
    cdef inline void ring(self, int q) noexcept nogil
    cdef int wait_for(self, int only, uint64_t step, int phase, WaitCtx *ctx, bint check) except -1 nogil
    cdef inline int wait_peer(self, int q, uint64_t step, int phase, WaitCtx *ctx, bint check) except -1 nogil
    cdef inline int wait_all(self, uint64_t step, int phase, WaitCtx *ctx, bint check) except -1 nogil
    cdef uint64_t peer_aux(self, int q) noexcept nogil
    cdef inline bint reached(self, int q, uint64_t target) noexcept nogil
    cdef int short_of(self, uint64_t target, int only, int skip) noexcept nogil


