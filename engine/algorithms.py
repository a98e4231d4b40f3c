"""Which allreduce algorithm runs: an ordered registry of (name, predicate); the first match wins.

ENGINE_ALLREDUCE_ALGO forces one (native | ring | rdouble); `auto` (the default) walks the rules.
CUDA tensors have their own registry of the same form (CudaAllreduceSelector): NCCL's allreduce or the
engine's ring over NCCL send/recv, forced with ENGINE_CUDA_ALLREDUCE_ALGO (nccl | ring).
Thresholds were chosen by measurement on 2-4 ranks (see BENCHMARKS.md) and can be overridden:
ENGINE_RDOUBLE_MAX_BYTES (largest message for recursive doubling) and ENGINE_RING_MIN_BYTES
(smallest message for the ring; between the two the native MPI collective runs).
"""

from .config import env_choice, env_int

ALGORITHMS = ("native", "ring", "rdouble")
CUDA_ALGORITHMS = ("nccl", "ring")
INT_MAX = 2**31 - 1


class AllreduceSelector:
    """Picks an algorithm per call from (message bytes, element count, group size)."""

    def __init__(self):
        self.forced = env_choice("ENGINE_ALLREDUCE_ALGO", ALGORITHMS + ("auto",), "auto")
        self.rdouble_max = env_int("ENGINE_RDOUBLE_MAX_BYTES", 16 << 10)
        self.ring_min = env_int("ENGINE_RING_MIN_BYTES", 32 << 10)
        # Ordered rules; the first whose predicate holds names the algorithm.
        self.rules = (
            ("native", lambda nbytes, count, size: size == 1),
            ("ring", lambda nbytes, count, size: count > INT_MAX),  # MPI's int counts can't hold it
            ("rdouble", lambda nbytes, count, size: nbytes <= self.rdouble_max),
            ("ring", lambda nbytes, count, size: nbytes >= self.ring_min),
            ("native", lambda nbytes, count, size: True),
        )

        self._memo = {}  # (nbytes, count, size) -> name: the rules run once per message size

    def choose(self, nbytes, count, size, requested=None):
        name = requested or self.forced
        if name == "auto":
            key = (nbytes, count, size)
            name = self._memo.get(key)
            if name is None:
                if len(self._memo) > 4096:
                    self._memo.clear()
                name = self._memo[key] = next(n for n, applies in self.rules if applies(nbytes, count, size))
            return name
        if name not in ALGORITHMS:
            raise ValueError(f"unknown allreduce algorithm {name!r}; expected one of {', '.join(ALGORITHMS)} or 'auto'")
        return name


class CudaAllreduceSelector:
    """Picks the GPU allreduce from (NCCL reduces this dtype and op itself, message bytes, group size)."""

    def __init__(self):
        self.forced = env_choice("ENGINE_CUDA_ALLREDUCE_ALGO", CUDA_ALGORITHMS + ("auto",), "auto")
        self.rules = (
            ("ring", lambda nccl_reduces, nbytes, size: not nccl_reduces),  # BAND/BOR/BXOR, int16: our kernels
            ("ring", lambda nccl_reduces, nbytes, size: self.forced == "ring"),
            ("nccl", lambda nccl_reduces, nbytes, size: True),
        )

    def choose(self, nccl_reduces, nbytes, size):
        return next(n for n, applies in self.rules if applies(nccl_reduces, nbytes, size))
