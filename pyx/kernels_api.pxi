# Python entry points to the C kernels: each parses its buffers, then runs one GIL-free call.

cdef eng_team _kernel_team    # the kernel calls' own helpers (reduce_into, copy_into with threads > 1)
cdef int _kernel_threads = 1
_kernel_team_lock = threading.Lock()


MAX_THREADS = ENG_TEAM_MAX_THREADS


def check_threads(threads, str what="threads", str also=""):
    """The one check of a thread count (the caller's thread included): 1 to MAX_THREADS."""
    if not 1 <= threads <= ENG_TEAM_MAX_THREADS:
        raise ValueError(f"{what}={threads}: expected a number of threads from 1 to {ENG_TEAM_MAX_THREADS}, "
                         f"this rank's thread included{also}")


cdef eng_team *_team_of(int threads) except? NULL:
    """The kernel calls' team of `threads` (NULL: one thread); the caller holds _kernel_team_lock."""
    global _kernel_threads
    cdef int rc
    check_threads(threads)
    if threads == 1:
        return NULL
    if threads != _kernel_threads:
        if _kernel_threads > 1:
            eng_team_stop(&_kernel_team)
            _kernel_threads = 1
        rc = eng_team_start(&_kernel_team, threads, 2, spin_budget(-1))
        if rc:
            raise OSError(rc, f"could not start {threads - 1} helper threads: {os.strerror(rc)}")
        _kernel_threads = threads
    return &_kernel_team


def copy_into(dst, src, int threads=1):
    """dst[:] = src (memcpy), split over `threads` threads (the caller's and helpers)."""
    cdef Message md = as_message(dst, True, "dst")
    cdef Message ms = as_message(src, False, "src")
    cdef size_t n = ms.count * ms.itemsize
    cdef eng_team *tm
    if md.count * md.itemsize != n:
        raise ValueError(f"dst holds {md.count * md.itemsize} bytes, src {n}: they must match")
    with _kernel_team_lock:
        tm = _team_of(threads)
        with nogil:
            eng_team_copy(tm, md.ptr, ms.ptr, n)


def reduce_into(dst, a, b, op, int threads=1):
    """dst = a (op) b element-wise; op is an int code from OP_NAMES (AVG excluded) or a user op;
    threads > 1 splits it into slices over that many threads (the team a threaded collective uses)."""
    cdef Message md = as_message(dst, True, "dst")
    cdef Message ma = as_message(a, False, "a")
    cdef Message mb = as_message(b, False, "b")
    if ma.dtype != md.dtype or mb.dtype != md.dtype or ma.count != md.count or mb.count != md.count:
        raise ValueError(f"dst, a and b must share dtype and length, got {DTYPE_NAMES[md.dtype]}[{md.count}], "
                         f"{DTYPE_NAMES[ma.dtype]}[{ma.count}], {DTYPE_NAMES[mb.dtype]}[{mb.count}]")
    cdef Reduction red = resolve_op(op, md.dtype)
    if red.c.avg:
        raise ValueError("AVG is SUM plus scale(); reduce_into takes SUM")
    cdef const void *srcs[2]
    cdef eng_team *tm
    cdef RaiseWatch raises
    raise_watch_begin(&raises, red.c.code < 0)
    try:
        if threads == 1:
            with nogil:
                red.c.fn(md.ptr, ma.ptr, mb.ptr, md.count)
        else:
            srcs[0], srcs[1] = ma.ptr, mb.ptr
            with _kernel_team_lock:
                tm = _team_of(threads)
                with nogil:
                    eng_team_reduce(tm, red.c.fn, md.ptr, NULL, srcs, 2, md.count, md.itemsize, md.dtype, 0.0)
    finally:
        raise_watch_end(&raises)
    user_op_check(red, raises.raised, "reduce_into")


def scale(buf, double factor, bint divide=False):
    """buf *= factor (or buf /= factor) in place; floating dtypes, float16/bfloat16 through float32."""
    cdef Message m = as_message(buf, True, "buffer")
    cdef int rc
    with nogil:
        rc = eng_scale(m.ptr, m.count, m.dtype, factor, divide)
    if rc:
        raise ValueError(f"scale needs a floating dtype, got {DTYPE_NAMES[m.dtype]}")


def avg_spread(int size):
    """The power of two AVG divides each input by before a group of `size` sums them (1 alone), so that
    a mean that fits its dtype never overflows on the way (dtypes.pxi avg_before)."""
    return eng_avg_spread(size)


cdef class _PartList:
    """Parsed parts: pointers and counts in C arrays, of one dtype (-1: they mix dtypes). parse_parts()
    hands one to Python, which passes it back to pack, unpack and allreduce_parts in place of the
    list: each buffer is read once. (Its fields: pyx/engine/_core.pxd.)"""

    def __dealloc__(self):
        free(self.ptrs)
        free(self.counts)

    def __len__(self):
        return self.n

    @property
    def dtype_name(self):
        return DTYPE_NAMES[self.dtype]

    @property
    def total_bytes(self):
        return self.total * eng_itemsize[self.dtype]

    @property
    def largest_bytes(self):
        """The largest part's size."""
        return self.largest * eng_itemsize[self.dtype]


cdef _PartList _parse_parts(object parts, bint writable, str role, bint one_dtype=True):
    """parts (a list of buffers, or a _PartList parse_parts made) read once; with one_dtype, parts
    of mixed dtypes are refused, else the list's dtype is -1."""
    cdef _PartList pl
    cdef Message m
    cdef size_t k
    if isinstance(parts, _PartList):
        return parts
    pl = _PartList.__new__(_PartList)
    pl.messages = list(parts)
    pl.n = len(pl.messages)
    pl.ptrs = <void**>malloc(max(pl.n, 1) * sizeof(void*))
    pl.counts = <size_t*>malloc(max(pl.n, 1) * sizeof(size_t))
    if pl.ptrs == NULL or pl.counts == NULL:
        raise MemoryError()
    pl.dtype = -2
    for k in range(pl.n):
        try:
            m = as_message(pl.messages[k], writable, role)
        except Exception:    # the message names the part (formatted here only: per part it would cost)
            as_message(pl.messages[k], writable, f"{role}[{k}]")
            raise
        pl.messages[k] = m
        if pl.dtype != -2 and m.dtype != pl.dtype:
            if one_dtype:
                raise TypeError(f"{role} mixes dtypes ({DTYPE_NAMES[pl.dtype]} and {DTYPE_NAMES[m.dtype]}); "
                                "pack each dtype into its own flat buffer")
            pl.dtype = -1
        elif pl.dtype == -2:
            pl.dtype = m.dtype
        pl.ptrs[k] = m.ptr
        pl.counts[k] = m.count
        pl.total += m.count
        if m.count > pl.largest:
            pl.largest = m.count
    if pl.dtype == -2:
        pl.dtype = -1
    return pl


def parse_parts(parts):
    """The writable buffers of parts read once, for pack, unpack and allreduce_parts to take in place
    of the list; None when they mix dtypes."""
    cdef _PartList pl = _parse_parts(parts, True, "parts", False)
    return pl if pl.dtype >= 0 else None


cdef int _by_start(const void *a, const void *b) noexcept nogil:
    cdef size_t x = (<const size_t*>a)[0], y = (<const size_t*>b)[0]
    return -1 if x < y else (1 if x > y else 0)


def parts_overlap(parts):
    """Whether two of parts (buffers, or what parse_parts made) share memory: the same tensor twice,
    or views of one buffer that overlap. A fused allreduce of such parts must read every one before it
    writes any result, as one flattened allreduce does (engine/fusion.py)."""
    cdef _PartList pl = _parse_parts(parts, False, "parts", False)
    cdef size_t *spans
    cdef size_t k, n = 0, end = 0
    cdef Message m
    cdef bint overlap = False
    if pl.n < 2:
        return False
    spans = <size_t*>malloc(2 * pl.n * sizeof(size_t))   # (start, end) pairs, by start
    if spans == NULL:
        raise MemoryError()
    for k in range(pl.n):
        m = <Message>pl.messages[k]
        if m.count:
            spans[2 * n] = <size_t>m.ptr
            spans[2 * n + 1] = <size_t>m.ptr + m.count * m.itemsize
            n += 1
    qsort(spans, n, 2 * sizeof(size_t), _by_start)
    for k in range(n):
        if k and spans[2 * k] < end:
            overlap = True
            break
        end = max(end, spans[2 * k + 1])
    free(spans)
    return overlap


def pack(parts, flat, double scale=1.0):
    """Copies parts (a list of buffers of one dtype) back to back into flat, casting to flat's dtype
    and multiplying by scale, in one GIL-free call. Returns the number of elements written."""
    return _pack_or_unpack(parts, flat, scale, False)


def unpack(flat, parts, double scale=1.0):
    """Splits flat back into parts (writable buffers of one dtype), casting and multiplying by scale."""
    return _pack_or_unpack(parts, flat, scale, True)


cdef size_t _pack_or_unpack(parts, flat, double scale, bint unpacking) except? 0:
    cdef _PartList pl = _parse_parts(parts, unpacking, "parts")
    cdef Message mf = as_message(flat, not unpacking, "flat")
    cdef int rc
    name = "unpack" if unpacking else "pack"
    if pl.n and not eng_convertible(mf.dtype, pl.dtype, scale) and not eng_convertible(pl.dtype, mf.dtype, scale):
        raise TypeError(f"cannot {name} {DTYPE_NAMES[pl.dtype]} parts with a {DTYPE_NAMES[mf.dtype]} flat buffer"
                        + (f" and scale {scale}" if scale != 1.0 else "")
                        + "; supported: same dtype, or float32 with float16/bfloat16 (scaling: floating dtypes)")
    if mf.count < pl.total:
        raise ValueError(f"flat buffer holds {mf.count} elements but the parts need {pl.total}")
    if pl.n == 0:
        return 0
    with nogil:
        rc = eng_move_range(not unpacking, mf.ptr, mf.dtype, mf.itemsize, pl.ptrs, pl.counts, pl.n, pl.dtype,
                            eng_itemsize[pl.dtype], scale, 0, SIZE_MAX)
    if rc:
        frm, to = (mf.dtype, pl.dtype) if unpacking else (pl.dtype, mf.dtype)
        raise TypeError(f"{name}: unsupported conversion {DTYPE_NAMES[frm]} -> {DTYPE_NAMES[to]}")
    return pl.total


# ---- which instruction set the kernels run (kernels.h compiles them once per ISA) ----

ISA_NAMES = tuple(eng_isa_names[i].decode() for i in range(ENG_NISAS))
_ISA_NEEDS = {"avx2": "avx2, bmi2, popcnt and f16c", "avx512": "avx512f, avx512bw, avx512vl and avx512dq"}
cdef int _active_isa = ENG_ISA_BASELINE


def kernel_isas():
    """The ISAs this build has and this CPU runs, lowest first (the kernels compute the same bits on each)."""
    return tuple(ISA_NAMES[i] for i in range(ENG_NISAS) if eng_isa_built(i) and eng_isa_supported(i))


def kernel_isa():
    """The ISA the kernels run: ENGINE_ISA's, or the highest this CPU runs."""
    return ISA_NAMES[_active_isa]


def use_kernel_isa(name):
    """Runs the kernels of ISA `name` ('auto': the highest this CPU runs) from now on, in this process;
    returns the one that ran before. Raises ValueError for a name this build doesn't know and
    RuntimeError for an ISA this build lacks or this CPU can't run."""
    global _active_isa
    cdef int isa
    previous = ISA_NAMES[_active_isa]
    key = str(name).strip().lower()
    if key in ("", "auto"):
        runs = kernel_isas()
        isa = ISA_NAMES.index(runs[len(runs) - 1])   # (no negative indexing: wraparound=False)
    elif key not in ISA_NAMES:
        raise ValueError(f"unknown kernel ISA {name!r}; expected auto or one of {', '.join(ISA_NAMES)}")
    else:
        isa = ISA_NAMES.index(key)
        if not eng_isa_built(isa):
            raise RuntimeError(f"kernel ISA {key!r} is not in this build (it exists on x86-64 builds by GCC or "
                               f"Clang); this build runs {', '.join(kernel_isas())}")
        if not eng_isa_supported(isa):
            raise RuntimeError(f"kernel ISA {key!r} needs a CPU with {_ISA_NEEDS.get(key, key)}, which this one "
                               f"lacks; it runs {', '.join(kernel_isas())}")
    if eng_isa_use(isa):
        raise RuntimeError(f"kernel ISA {key!r} could not be selected")
    _active_isa = isa
    forget_resolved_ops()               # they hold the previous ISA's kernels
    return previous


def _kernel_slot():
    """Where the active kernel table lives, for engine._mpi (which compiles kernels.h too) to read."""
    return eng_isa_slot()


def _kernel_table():
    """The address of the kernel table this module runs (engine._mpi has the same function: the two agree)."""
    return eng_isa_table()


def _choose_isa_from_env():
    raw = os.environ.get("ENGINE_ISA", "")
    try:
        use_kernel_isa(raw)
    except (ValueError, RuntimeError) as exc:
        raise RuntimeError(f"ENGINE_ISA={raw!r}: {exc}; unset ENGINE_ISA to choose automatically") from None


_choose_isa_from_env()
