"""Which allreduce algorithm runs: an ordered registry of rules; the first that matches wins.

Rules are data, (algorithm, smallest bytes, largest bytes, fewest ranks, most ranks), handed to the
compiled core, which walks them on every call without Python. Each transport has its algorithms:

- mpi: native (MPI_Allreduce), ring (the engine's ring over MPI point-to-point), rdouble (recursive
  doubling);
- shm: oneshot (every rank reduces every rank's slot), twoshot (reduce-scatter + allgather through
  the segment), and ring / rdouble over the segment's point-to-point queues.

ENGINE_ALLREDUCE_ALGO forces one (for the group's transport); `auto` (the default) uses the rules.
Thresholds were chosen by measurement on this project's machines (docs/tuning.md) and can be
overridden: ENGINE_RDOUBLE_MAX_BYTES, ENGINE_RING_MIN_BYTES (mpi); ENGINE_SHM_ONESHOT_MAX_BYTES (shm).
A tuning file measured on the machine (ENGINE_TUNING_FILE, engine.tuning) puts its rules first.
CUDA tensors have their own registry of the same form (CudaAllreduceSelector): NCCL's allreduce or the
engine's ring over NCCL send/recv, forced with ENGINE_CUDA_ALLREDUCE_ALGO (nccl | ring).
"""

from . import tuning
from .config import env_choice, env_int

ALGORITHMS = {"mpi": ("native", "ring", "rdouble"), "shm": ("oneshot", "twoshot", "ring", "rdouble")}
CUDA_ALGORITHMS = ("nccl", "ring")
EVERY = 1 << 62


class AllreduceSelector:
    """The allreduce rules of one transport, given to a core (engine._core.CoreComm.set_rules)."""

    def __init__(self, transport="mpi"):
        self.transport = transport
        known = sorted({a for names in ALGORITHMS.values() for a in names})
        self.forced = env_choice("ENGINE_ALLREDUCE_ALGO", tuple(known) + ("auto",), "auto")
        if self.forced != "auto" and self.forced not in ALGORITHMS[transport]:
            raise ValueError(f"ENGINE_ALLREDUCE_ALGO={self.forced} does not exist on the {transport} transport; "
                             f"it runs {', '.join(ALGORITHMS[transport])}")
        if transport == "mpi":
            rdouble_max = env_int("ENGINE_RDOUBLE_MAX_BYTES", 256 << 10)
            ring_min = env_int("ENGINE_RING_MIN_BYTES", 32 << 10)
            self.rules = [("native", 0, EVERY, 1, 1),          # a group of one: nothing to exchange
                          ("rdouble", 0, rdouble_max, 2, EVERY),
                          ("ring", ring_min, EVERY, 2, EVERY)]
            self.default = "native"
        else:
            self.rules = [("oneshot", 0, env_int("ENGINE_SHM_ONESHOT_MAX_BYTES", 64 << 10), 1, EVERY)]
            self.default = "twoshot"
        self.rules = tuning.allreduce_rules(transport) + self.rules

    def configure(self, core):
        if self.forced != "auto":
            core.set_rules([], self.forced)
        else:
            core.set_rules(self.rules, self.default)


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
