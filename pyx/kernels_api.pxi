# Python entry points to the C kernels: each parses its buffers, then runs one GIL-free call.

def reduce_into(dst, a, b, op):
    """dst = a (op) b element-wise; op is an int code from OP_NAMES (AVG excluded) or a user op."""
    cdef Message md = as_message(dst, True, "dst")
    cdef Message ma = as_message(a, False, "a")
    cdef Message mb = as_message(b, False, "b")
    if ma.dtype != md.dtype or mb.dtype != md.dtype or ma.count != md.count or mb.count != md.count:
        raise ValueError(f"dst, a and b must share dtype and length, got {DTYPE_NAMES[md.dtype]}[{md.count}], "
                         f"{DTYPE_NAMES[ma.dtype]}[{ma.count}], {DTYPE_NAMES[mb.dtype]}[{mb.count}]")
    cdef Reduction red = resolve_op(op, md.dtype)
    if red.c.avg:
        raise ValueError("AVG is SUM plus scale(); reduce_into takes SUM")
    with nogil:
        red.c.fn(md.ptr, ma.ptr, mb.ptr, md.count)


def scale(buf, double factor, bint divide=False):
    """buf *= factor (or buf /= factor) in place; floating dtypes, float16/bfloat16 through float32."""
    cdef Message m = as_message(buf, True, "buffer")
    cdef int rc
    with nogil:
        rc = eng_scale(m.ptr, m.count, m.dtype, factor, divide)
    if rc:
        raise ValueError(f"scale needs a floating dtype, got {DTYPE_NAMES[m.dtype]}")


cdef class _PartList:
    """Parsed parts of a pack/unpack: pointers and counts in C arrays, one dtype."""
    def __dealloc__(self):
        free(self.ptrs)
        free(self.counts)


cdef _PartList _parse_parts(object parts, bint writable, str role):
    cdef _PartList pl = _PartList.__new__(_PartList)
    cdef Message m
    cdef size_t k
    pl.messages = [as_message(p, writable, f"{role}[{k}]") for k, p in enumerate(parts)]
    pl.n = len(pl.messages)
    pl.ptrs = <void**>malloc(max(pl.n, 1) * sizeof(void*))
    pl.counts = <size_t*>malloc(max(pl.n, 1) * sizeof(size_t))
    if pl.ptrs == NULL or pl.counts == NULL:
        raise MemoryError()
    pl.dtype = -1
    for k in range(pl.n):
        m = pl.messages[k]
        if pl.dtype >= 0 and m.dtype != pl.dtype:
            raise TypeError(f"{role} mixes dtypes ({DTYPE_NAMES[pl.dtype]} and {DTYPE_NAMES[m.dtype]}); "
                            "pack each dtype into its own flat buffer")
        pl.dtype = m.dtype
        pl.ptrs[k] = m.ptr
        pl.counts[k] = m.count
        pl.total += m.count
    return pl


cdef _check_flat(Message flat, _PartList pl, double factor, str verb):
    if pl.n and not eng_convertible(flat.dtype, pl.dtype, factor) and not eng_convertible(pl.dtype, flat.dtype, factor):
        raise TypeError(f"cannot {verb} {DTYPE_NAMES[pl.dtype]} parts with a {DTYPE_NAMES[flat.dtype]} flat buffer"
                        + (f" and scale {factor}" if factor != 1.0 else "")
                        + "; supported: same dtype, or float32 with float16/bfloat16 (scaling: floating dtypes)")
    if flat.count < pl.total:
        raise ValueError(f"flat buffer holds {flat.count} elements but the parts need {pl.total}")


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
    _check_flat(mf, pl, scale, name)
    if pl.n == 0:
        return 0
    with nogil:
        if unpacking:
            rc = eng_unpack(mf.ptr, mf.dtype, mf.itemsize, pl.ptrs, pl.counts, pl.n, pl.dtype, eng_itemsize[pl.dtype], scale)
        else:
            rc = eng_pack(mf.ptr, mf.dtype, mf.itemsize, pl.ptrs, pl.counts, pl.n, pl.dtype, eng_itemsize[pl.dtype], scale)
    if rc:
        frm, to = (mf.dtype, pl.dtype) if unpacking else (pl.dtype, mf.dtype)
        raise TypeError(f"{name}: unsupported conversion {DTYPE_NAMES[frm]} -> {DTYPE_NAMES[to]}")
    return pl.total
