"""Tensor fusion: many small allreduces as a few large ones (Horovod's Tensor Fusion, DDP's buckets).

plan_buckets() is pure planning (which tensors share a bucket); FusedAllreduce owns the flat buffers
(allocated once per dtype and grown, never per call) and moves data: pack (one GIL-free kernel call per
bucket, with the dtype cast of compression and the AVG/PREMUL scale fused in), one allreduce per bucket,
unpack. With several buckets a helper thread packs bucket k+1 and unpacks bucket k-1 while bucket k is
being reduced. Over shared memory the copy the transport needs anyway is the pack: each bucket is
packed straight into the segment and unpacked straight out of it (Communicator.allreduce_parts), so a
bucket costs two copies instead of four and needs no flat buffer. A call is checked whole before any
of its data moves: a bucket refused half way would leave the buckets before it reduced.
"""

import functools
import operator
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass

from . import _core, forks
from .config import env_int
from .ops import ReduceOp, op_code

DEFAULT_BUCKET_BYTES = 32 << 20  # measured best of 1, 4, 32 MB on 2 ranks x 2 cores: BENCHMARKS.md
# Tensors this large travel alone, in place: one call's overhead (~9 us) is under 5% of their
# allreduce, while packing would copy them twice (BENCHMARKS.md, "Fusion").
DEFAULT_DIRECT_BYTES = 256 << 10
COMPRESSIONS = (None, "float16", "bfloat16")


def bucket_sizes(bucket_bytes=None, direct_bytes=None):
    """(bucket cap, direct size) in bytes: the arguments, else ENGINE_BUCKET_BYTES and
    ENGINE_FUSION_DIRECT_BYTES as they are now, else the defaults; the fusions (CPU, CUDA, at each call)
    and DistributedOptimizer read them here. A direct size of 0 sends every tensor alone (no packing)."""
    # (checked before the cache, whose keys take 2048.0 for 2048 and True for 1)
    return _sizes(_given_size("bucket_bytes", bucket_bytes, 1), _given_size("direct_bytes", direct_bytes, 0),
                  os.environ.get("ENGINE_BUCKET_BYTES"), os.environ.get("ENGINE_FUSION_DIRECT_BYTES"))


@functools.lru_cache(maxsize=16)
def _sizes(bucket_bytes, direct_bytes, *settings):
    # (settings: the variables' text, the cache's key: every fused call reads them, and parsing costs
    # more than the look-up)
    return (env_int("ENGINE_BUCKET_BYTES", DEFAULT_BUCKET_BYTES, minimum=1) if bucket_bytes is None
            else bucket_bytes,
            env_int("ENGINE_FUSION_DIRECT_BYTES", DEFAULT_DIRECT_BYTES, minimum=0) if direct_bytes is None
            else direct_bytes)


def _given_size(name, given, least):
    """A size given as an argument: a whole number (numpy's too) of at least `least` bytes, or None."""
    try:
        value = None if given is None or isinstance(given, bool) else operator.index(given)
    except TypeError:
        value = None
    if given is not None and (value is None or value < least):
        raise ValueError(f"{name}={given!r}: expected a whole number of bytes, at least {least} "
                         f"(or None: the environment's, else the default)")
    return value


class SizedFusion:
    """A fusion's bucket cap and direct size: those it was made with, else the environment's at each
    call (a group's fusion is made once, with the group, and the settings are documented per call)."""

    def __init__(self, bucket_bytes=None, direct_bytes=None):
        self._given = (bucket_bytes, direct_bytes)
        bucket_sizes(bucket_bytes, direct_bytes)   # (a setting it can't use fails where the group is made)

    @property
    def sizes(self):
        """(bucket cap, direct size) in bytes, now."""
        return bucket_sizes(*self._given)

    @property
    def bucket_bytes(self):
        return self.sizes[0]

    @property
    def direct_bytes(self):
        return self.sizes[1]


@dataclass(frozen=True)
class Bucket:
    """Tensors (by index into the caller's list) that travel in one flat buffer."""

    dtype: str
    device: str
    indices: tuple
    count: int  # elements


def plan_buckets(specs, cap_bytes, direct_bytes=None):
    """Groups tensors into buckets. specs: one (element count, dtype name, item size, device) per
    tensor, in the order they should travel. Tensors of one (dtype, device) fill a bucket in order
    until the next would pass cap_bytes; a tensor larger than the cap, or of direct_bytes or more,
    travels alone (reduced in place, no copy). Empty tensors need no communication and get no bucket.
    Pure and deterministic: every rank plans the same."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    direct_bytes = cap_bytes if direct_bytes is None else min(direct_bytes, cap_bytes)
    open_buckets = {}  # (dtype, device) -> [indices, count, nbytes]
    done = []
    for i, (count, dtype, itemsize, device) in enumerate(specs):
        if count == 0:
            continue
        key = (dtype, device)
        nbytes = count * itemsize
        if nbytes >= direct_bytes:
            # Travels alone; it also closes the open bucket, so buckets keep the order tensors arrive
            # in (gradients ready early travel early instead of waiting for a late small tensor).
            if key in open_buckets:
                done.append((key, open_buckets.pop(key)))
            done.append((key, [[i], count, nbytes]))
            continue
        cur = open_buckets.get(key)
        if cur is not None and cur[2] + nbytes > cap_bytes:
            done.append((key, cur))
            cur = None
        if cur is None:
            cur = open_buckets[key] = [[], 0, 0]
        cur[0].append(i)
        cur[1] += count
        cur[2] += nbytes
    done.extend(open_buckets.items())
    # Order buckets by their first tensor, so communication follows the caller's order.
    done.sort(key=lambda kv: kv[1][0][0])
    return [Bucket(dtype, device, tuple(idx), count) for (dtype, device), (idx, count, _) in done]


def wire_dtype(dtype, compression):
    """The dtype a bucket travels in: float32 buckets take the compression dtype."""
    return compression if compression and dtype == "float32" else dtype


def bucket_scales(code, wire, dtype, size, prescale):
    """(factor applied on pack, factor applied on unpack) of one bucket. AVG divides before the sum,
    so a mean that fits the dtype never comes back as an overflowed sum: compressed, by the size (as
    torch's fp16 hook does, before the cast to half precision); otherwise by the power of two at or
    over the size (exact), and by what is left on unpack, as a plain allreduce's AVG does, but as a
    multiplication by its reciprocal (the unpack's, the segment's copy-out's and the CUDA kernels'
    scale): within one unit in the last place of the plain call's division where the size is not a
    power of two and no input divided first falls below the dtype's normal range (float16 under
    6.1e-5: such an input keeps fewer bits, as under NCCL's AVG, which divides first too). Pure: shared
    by the CPU and GPU fusion."""
    if code != ReduceOp.AVG:
        return prescale, 1.0
    if wire != dtype:
        return prescale / size, 1.0
    spread = _core.avg_spread(size)
    return prescale / spread, spread / size


def check_reducible(like, dtype, code, prescale=1.0):
    """Raises what a plain allreduce of `dtype` under `code` raises (AVG of integers among it), or scale()'s
    error for a prescale of a dtype that can't be scaled. The kernels are asked, on an empty view of
    `like` (a tensor or array of `dtype`), so the rules stay in one place (pyx/dtypes.pxi)."""
    probe = like.reshape(-1)[:0]
    try:
        _core.scale(probe, prescale)   # (no elements: only whether dtype scales)
    except ValueError:
        if code == ReduceOp.AVG:   # (it raises: AVG needs a dtype that scales)
            _core.reduce_into(probe, probe, probe, code)
        if prescale != 1.0:
            raise
    if code != ReduceOp.AVG:   # (reduce_into refuses AVG itself; its SUM reduces every dtype that scales)
        _core.reduce_into(probe, probe, probe, code)


class FusedAllreduce(SizedFusion):
    """Allreduce of a list of tensors/arrays through fused buckets, in place."""

    def __init__(self, comm, bucket_bytes=None, direct_bytes=None):
        super().__init__(bucket_bytes, direct_bytes)
        self.comm = comm
        self._checked = set()  # (dtype, op, prescaled) that check_reducible passed
        self._buffers = {}  # (wire dtype, slot) -> flat buffer, grown on demand
        self._worker = None
        self._lock = threading.Lock()
        forks.track(self)

    def run(self, tensors, op=ReduceOp.SUM, *, compression=None, prescale=1.0):
        """tensors[i] = op over ranks of tensors[i], for every i. compression: None, 'float16' or
        'bfloat16' (float32 tensors travel in that dtype). prescale multiplies inputs first (PREMUL_SUM)."""
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if not isinstance(tensors, (list, tuple)):   # (an iterator would be used up by the first look)
            raise TypeError(f"FusedAllreduce.run takes a list or tuple of tensors, got {type(tensors).__name__}")
        code = op_code(op)
        parts = _core.parse_parts(tensors)   # (read once, in C; None where they mix dtypes)
        if _core.parts_overlap(tensors if parts is None else parts):
            return self._run_on_copies(tensors, op, compression, prescale)
        summed = ReduceOp.SUM if code == ReduceOp.AVG else code  # (AVG's division: on pack or unpack)
        cap, direct = self.sizes
        in_segment = getattr(self.comm, "packs_in_segment", False)
        if in_segment:
            # Where every tensor is of one dtype, none travels alone and all fit one bucket (many small
            # tensors: all_reduce_coalesced), that bucket is plan_buckets' plan.
            if parts is not None and parts.largest_bytes < min(direct, cap) and parts.total_bytes <= cap:
                self._check(tensors[0], parts.dtype_name, code, prescale)
                if parts.total_bytes:
                    self._reduce_in_segment(parts, parts.dtype_name, code, summed, compression, prescale)
                return tensors
        # The MPI path takes host memory only (the buffer layer refuses device tensors), so every
        # bucket here is a "cpu" one; the device field keeps plans ready for device-side fusion.
        specs = [(count, dtype, itemsize, "cpu") for count, itemsize, dtype in map(_core.message_shape, tensors)]
        first_of = {}  # dtype -> its first tensor; empty ones count too (a plain allreduce refuses those as well)
        for i, spec in enumerate(specs):
            first_of.setdefault(spec[1], i)
        for dtype, i in first_of.items():
            self._check(tensors[i], dtype, code, prescale)
        buckets = plan_buckets(specs, cap, direct)
        if not buckets:
            return tensors
        if in_segment:
            for bucket in buckets:
                self._reduce_in_segment([tensors[i] for i in bucket.indices], bucket.dtype, code, summed,
                                        compression, prescale)
            return tensors
        for bucket in buckets:   # (every flat buffer can be made: checked before any bucket moves)
            _check_flat(tensors[bucket.indices[0]], wire_dtype(bucket.dtype, compression))
        with self._lock:  # the flat buffers are shared by the calls of this object
            if len(buckets) == 1:  # nothing to pipeline: no helper thread
                flat, scale_after = self._pack(tensors, buckets[0], 0, code, compression, prescale)
                self.comm.allreduce(flat, op=summed)
                self._unpack(flat, scale_after, tensors, buckets[0])
            else:
                self._pipelined(tensors, buckets, code, summed, compression, prescale)
        return tensors

    def _run_on_copies(self, tensors, op, compression, prescale):
        """run() of tensors that share memory (the same one twice, overlapping views): each is read
        into a copy first and written back after, in order, as one flattened allreduce reads every
        input before it writes any result (Gloo's allreduce_coalesced). In place, a part travelling
        alone, or a bucket packed after another's unpack, read what was already reduced."""
        copies = []
        for t in tensors:
            count, _, dtype = _core.message_shape(t)
            copies.append(_empty_like(t, dtype, count))
            _core.pack([t], copies[-1])
        self.run(copies, op, compression=compression, prescale=prescale)
        for t, c in zip(tensors, copies):
            _core.unpack(c, [t])
        return tensors

    def _check(self, like, dtype, code, prescale):
        key = (dtype, code, prescale != 1.0)
        if key not in self._checked:
            check_reducible(like, dtype, code, prescale)
            self._checked.add(key)

    def _reduce_in_segment(self, parts, dtype, code, summed, compression, prescale):
        """One bucket's parts (of `dtype`), packed straight into the shared segment and out of it."""
        wire = wire_dtype(dtype, compression)
        before, after = bucket_scales(code, wire, dtype, self.comm.size, prescale)
        self.comm.allreduce_parts(parts, summed, wire, before, after)

    def _pipelined(self, tensors, buckets, code, summed, compression, prescale):
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="engine-fusion")
        submitted = []

        def submit(fn, *args):
            submitted.append(self._worker.submit(fn, *args))
            return submitted[-1]

        try:
            pending = submit(self._pack, tensors, buckets[0], 0, code, compression, prescale)
            for k, bucket in enumerate(buckets):
                flat, scale_after = pending.result()
                if k + 1 < len(buckets):  # packs into the other slot, after that slot's unpack (same worker)
                    pending = submit(self._pack, tensors, buckets[k + 1], (k + 1) % 2, code, compression, prescale)
                self.comm.allreduce(flat, op=summed)
                submit(self._unpack, flat, scale_after, tensors, bucket)
        finally:
            # Whether or not this call fails, none of its work may outlive it: the worker writes the
            # caller's tensors, and the slot buffers are the next call's.
            wait_all(submitted)
        for f in submitted:  # the first failure
            f.result()

    def _pack(self, tensors, bucket, slot, code, compression, prescale):
        """(flat buffer holding the bucket, scale to apply on unpack)."""
        wire = wire_dtype(bucket.dtype, compression)
        before, after = bucket_scales(code, wire, bucket.dtype, self.comm.size, prescale)
        parts = [tensors[i] for i in bucket.indices]
        if len(parts) == 1 and wire == bucket.dtype:  # nothing to fuse: reduce the tensor itself, in place
            if before != 1.0:
                _core.scale(parts[0], before)   # (the sum overwrites it)
            return parts[0], after
        flat = self._buffer(parts[0], wire, slot, bucket.count)
        _core.pack(parts, flat, before)
        return flat, after

    def _unpack(self, flat, scale_after, tensors, bucket):
        parts = [tensors[i] for i in bucket.indices]
        if len(parts) == 1 and flat is parts[0]:
            if scale_after != 1.0:
                _core.scale(flat, scale_after)
            return
        _core.unpack(flat, parts, scale_after)

    def _buffer(self, like, dtype, slot, count):
        key = (dtype, slot, type(like))
        buf = self._buffers.get(key)
        if buf is None or len(buf) < count:
            buf = self._buffers[key] = _empty_like(like, dtype, max(count, self.bucket_bytes // ITEMSIZE[dtype]))
        return buf[:count]

    def orphan(self, why):
        """In a child forked from this process: the helper thread is not there, and the lock may have been
        copied held (the calls themselves are refused by the group, engine/forks.py)."""
        self._worker = None
        self._lock = threading.Lock()

    def close(self):
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


ITEMSIZE = dict(zip(_core.DTYPE_NAMES, _core.DTYPE_ITEMSIZES))  # dtype name -> bytes


def _empty_like(like, dtype, count):
    """A flat buffer of the same kind as `like` (torch tensor or numpy array)."""
    mod = type(like).__module__.split(".")[0]
    if mod == "torch":
        import torch
        return torch.empty(count, dtype=getattr(torch, dtype))
    import numpy as np
    _check_flat(like, dtype)
    return np.empty(count, dtype=dtype)


def _check_flat(like, dtype):
    """Raises where no flat buffer of `dtype` is made of like's kind: numpy has no bfloat16."""
    if dtype == "bfloat16" and type(like).__module__.split(".")[0] != "torch":
        raise TypeError("bfloat16 compression needs torch tensors (numpy has no bfloat16) outside shared memory, "
                        "whose segment is the flat buffer")
