# One layer turns any buffer into (pointer, element count, dtype): torch CPU tensors (read through
# their own accessors, no copy, bfloat16 included), the buffer protocol (numpy, bytearray, ...) and
# DLPack. Every collective and kernel takes its buffers through as_message().

from cpython.buffer cimport (PyObject_CheckBuffer, PyObject_GetBuffer, PyBuffer_Release,
                             PyBUF_FORMAT, PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE,
                             PyBUF_STRIDES)
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_SetName

cdef class Message:
    """A contiguous CPU buffer seen as (ptr, count, dtype); keeps its owner alive while in use."""

    def __dealloc__(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
        if self.managed != NULL and self.managed.deleter != NULL:
            self.managed.deleter(self.managed)


cdef dict _TORCH_DTYPES = None   # torch.dtype -> engine dtype code, filled on first torch tensor
cdef object _TorchTensor = None


cdef bint _is_torch_tensor(object obj):
    global _TorchTensor, _TORCH_DTYPES
    if _TorchTensor is None:
        torch = sys.modules.get("torch")
        if torch is None:   # torch not imported: obj can't be a tensor
            return False
        _TorchTensor = torch.Tensor
        _TORCH_DTYPES = {getattr(torch, name): code for code, name in enumerate(DTYPE_NAMES)
                         if hasattr(torch, name)}
    return isinstance(obj, _TorchTensor)


# Formats whose dtype doesn't depend on the item size (the integer codes' do: 'l' is 4 or 8 bytes).
_FIXED_FORMATS = {b"?": ENG_BOOL, b"e": ENG_FLOAT16, b"f": ENG_FLOAT32, b"d": ENG_FLOAT64,
                  b"Zf": ENG_COMPLEX64, b"Zd": ENG_COMPLEX128}
# (DLPack type code, bits) -> dtype (the buffer protocol's integer formats are looked up here too).
cdef dict _DLPACK_DTYPES = {
    (kDLBool, 8): ENG_BOOL, (kDLInt, 8): ENG_INT8, (kDLUInt, 8): ENG_UINT8, (kDLInt, 16): ENG_INT16,
    (kDLUInt, 16): ENG_UINT16, (kDLInt, 32): ENG_INT32, (kDLUInt, 32): ENG_UINT32, (kDLInt, 64): ENG_INT64,
    (kDLUInt, 64): ENG_UINT64, (kDLFloat, 16): ENG_FLOAT16, (kDLBfloat, 16): ENG_BFLOAT16,
    (kDLFloat, 32): ENG_FLOAT32, (kDLFloat, 64): ENG_FLOAT64, (kDLComplex, 64): ENG_COMPLEX64,
    (kDLComplex, 128): ENG_COMPLEX128, (kDLFloat8_e4m3fn, 8): ENG_FLOAT8_E4M3FN, (kDLFloat8_e5m2, 8): ENG_FLOAT8_E5M2,
    (kDLFloat8_e4m3fnuz, 8): ENG_FLOAT8_E4M3FNUZ, (kDLFloat8_e5m2fnuz, 8): ENG_FLOAT8_E5M2FNUZ,
    (kDLFloat8_e8m0fnu, 8): ENG_FLOAT8_E8M0FNU}


cdef int _format_dtype(const char *fmt, Py_ssize_t itemsize) except -2:
    """The engine dtype of a buffer-protocol (struct module) format string, or -1."""
    cdef bytes f = fmt if fmt != NULL else b"B"
    if f[:1] in (b"<", b"=", b"@"):
        f = f[1:]
    elif f[:1] in (b">", b"!"):
        return -1
    if f in _FIXED_FORMATS:
        return _FIXED_FORMATS[f]
    if len(f) == 1 and f in b"bhilqBHILQc":    # integers: signed or not, of the item size
        return _DLPACK_DTYPES.get((kDLInt if f in b"bhilq" else kDLUInt, 8 * itemsize), -1)
    return -1


cdef str _describe(object obj):
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


cdef Message as_message(object obj, bint writable, str role):
    """Reads obj as a contiguous CPU buffer; raises TypeError/ValueError naming `role` and the fix."""
    cdef Message m = Message.__new__(Message)
    cdef int flags, code
    cdef DLManagedTensor *mt
    cdef DLTensor *t
    cdef long long expect
    cdef Py_ssize_t i
    m.owner = obj
    if _is_torch_tensor(obj):
        if not obj.is_cpu:
            if obj.is_meta:   # (torch's own backends let torch's meta kernels take such a call: a Python group can't)
                raise ValueError(
                    f"{role} is a meta tensor, which holds no data: backend 'engine' moves none for it; skip the call "
                    "for meta tensors, or make them real first (module.to_empty(device='cpu'), "
                    "torch.empty_like(t, device='cpu'))")
            raise ValueError(
                f"{role} is a {obj.device} tensor: an engine.Communicator moves CPU tensors only; move it "
                "with .cpu() (torch.distributed's backend 'engine' takes CUDA tensors, through NCCL)")
        code = _TORCH_DTYPES.get(obj.dtype, -1)
        if code < 0:
            raise TypeError(f"{role} has dtype {obj.dtype}, which the engine does not support; "
                            f"supported: {', '.join(DTYPE_NAMES)}")
        try:
            dense = obj.is_contiguous()
        except RuntimeError:   # (a sparse CSR tensor has no such property)
            if str(obj.layout) == "torch.strided":
                raise
            dense = False
        if not dense:
            if str(obj.layout) != "torch.strided":   # (its .contiguous() is no dense buffer either)
                raise NotDenseError(f"{role} is a {obj.layout} tensor: the engine moves dense tensors; pass "
                                "tensor.to_dense() (dist.all_reduce on backend 'engine' sums sparse COO tensors)")
            raise NotContiguousError(f"{role} is not contiguous; pass tensor.contiguous() "
                             "(and copy the result back if it is an output)")
        if obj.is_neg() or (code == ENG_COMPLEX64 or code == ENG_COMPLEX128) and obj.is_conj():
            # (its memory holds what the tensor shows negated, or conjugated: torch applies the bit lazily)
            fix = "resolve_neg" if obj.is_neg() else "resolve_conj"
            raise ValueError(f"{role} is a lazily {'negated' if obj.is_neg() else 'conjugated'} view (its memory "
                             f"holds the values before that); pass tensor.{fix}() (and copy the result back if "
                             "it is an output)")
        m.ptr = <void*><size_t>obj.data_ptr()
        m.count = obj.numel()
    elif PyObject_CheckBuffer(obj):
        flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
        try:
            PyObject_GetBuffer(obj, &m.view, flags)
        except (BufferError, ValueError) as exc:   # (numpy raises ValueError: "... is read-only")
            try:   # (what its layout can't explain: a dtype no buffer carries, numpy's datetime64)
                PyObject_GetBuffer(obj, &m.view, PyBUF_FORMAT | PyBUF_STRIDES)
            except (BufferError, ValueError) as why:
                raise TypeError(f"{role} ({_describe(obj)}) has a dtype the engine does not support ({why}); "
                                f"supported dtypes: {', '.join(DTYPE_NAMES)}") from None
            ro = "read-only" if writable and m.view.readonly else "not C-contiguous"
            PyBuffer_Release(&m.view)
            if writable:
                raise ValueError(f"{role} ({_describe(obj)}) is {ro}; the engine writes into it, so pass "
                                 "a writable C-contiguous array (e.g. numpy.ascontiguousarray(x).copy())") from exc
            raise ValueError(f"{role} ({_describe(obj)}) is not C-contiguous; "
                             "pass a C-contiguous copy (numpy.ascontiguousarray(x))") from exc
        m.has_view = True
        code = _format_dtype(m.view.format, m.view.itemsize)
        if code < 0:
            raise TypeError(f"{role} has buffer format {m.view.format!r}, which the engine does not support; "
                            f"supported dtypes: {', '.join(DTYPE_NAMES)} (native byte order)")
        m.ptr = m.view.buf
        m.count = <size_t>(m.view.len // m.view.itemsize)
    elif hasattr(obj, "__dlpack__"):
        capsule = obj.__dlpack__()
        if not PyCapsule_IsValid(capsule, b"dltensor"):
            raise TypeError(f"{role}: __dlpack__ returned an unexpected capsule")
        mt = <DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        PyCapsule_SetName(capsule, b"used_dltensor")
        m.managed = mt
        t = &mt.dl_tensor
        if t.device.device_type != kDLCPU and t.device.device_type != kDLCUDAHost:
            raise ValueError(f"{role} lives on DLPack device type {t.device.device_type}; an engine.Communicator "
                             "moves host memory only")
        code = _DLPACK_DTYPES.get((t.dtype.code, t.dtype.bits), -1) if t.dtype.lanes == 1 else -1
        if t.dtype.code == kDLFloat4_e2m1fn and t.dtype.bits == 4 and t.dtype.lanes == 2:
            code = ENG_FLOAT4_E2M1FN_X2   # (two 4-bit values a byte: torch's float4_e2m1fn_x2)
        if code < 0:
            raise TypeError(f"{role} has an unsupported DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits)")
        m.count = 1
        for i in range(t.ndim):
            m.count *= <size_t>t.shape[i]
        if t.strides != NULL and m.count > 1:
            expect = 1
            for i in range(t.ndim - 1, -1, -1):
                if t.shape[i] != 1 and t.strides[i] != expect:
                    raise ValueError(f"{role} is not C-contiguous; pass a contiguous copy")
                expect *= t.shape[i]
        m.ptr = <char*>t.data + t.byte_offset
    else:
        raise TypeError(f"{role} must be a buffer (numpy array, torch CPU tensor, bytearray or a DLPack "
                        f"object), got {_describe(obj)}")
    m.dtype = code
    m.itemsize = eng_itemsize[code]
    return m


cdef Message apart(Message ms, Message mr, const char *in_place):
    """A call's input as it reads it: ms itself, or a copy of it where its bytes overlap the output's,
    mr's, other than as the call's in-place layout (ms at `in_place`; NULL: the call has none). The
    algorithms read the peers' inputs while the outputs are written, so an input the output
    overwrites would be read half written (Gloo copies too; NCCL leaves the overlap undefined)."""
    cdef size_t sb = ms.count * ms.itemsize, rb = mr.count * mr.itemsize
    cdef const char *s = <const char*>ms.ptr
    cdef const char *r = <const char*>mr.ptr
    cdef Message copy
    if not sb or not rb or s + sb <= r or r + rb <= s or s == in_place:
        return ms
    copy = Message.__new__(Message)
    copy.owner = bytearray(sb)
    copy.ptr = PyByteArray_AS_STRING(copy.owner)
    memcpy(copy.ptr, ms.ptr, sb)
    copy.count, copy.dtype, copy.itemsize = ms.count, ms.dtype, ms.itemsize
    return copy


def message_info(obj, bint writable=False):
    """(address, count, dtype name) of obj as the engine sees it; for tests and debugging."""
    cdef Message m = as_message(obj, writable, "buffer")
    return (<size_t>m.ptr, m.count, DTYPE_NAMES[m.dtype])


def message_shape(obj):
    """(element count, item size, dtype name) of obj: what algorithm choice and bucket planning need."""
    cdef Message m = as_message(obj, False, "buffer")
    return m.count, m.itemsize, DTYPE_NAMES[m.dtype]


cdef int same_dtype(Message a, Message b, str what) except -1:
    """A call's send and receive buffers must hold one dtype (the engine converts none)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: send buffer is {DTYPE_NAMES[a.dtype]} but receive buffer is "
                        f"{DTYPE_NAMES[b.dtype]}; they must have the same dtype")
    return 0
