"""Ranks whose ENGINE_* settings differ, each case on a fresh group of every rank (ENGINE_SOCKETS=2
so that a shared-memory group of 4 runs in two levels): under mpiexec an engine.Communicator, under
torchrun torch's new_group(backend="engine"), made through torch's store (MPI's cases skipped). Rank 0
alone sets the case's variable. Every rank must refuse the group at once, naming the variable and
both values, where before a rank cut the same call differently: a two-shot step size read a peer's
blocks as its own and returned a wrong sum, other sizes failed or hung in the call, a hierarchy made
on some ranks only hung the others in its next split, ranks opening different transports or
connecting differently waited for each other for ever. A rank that can't read its settings (a
tuning file missing on its host) tells the others; a rank's own thread slices may differ. Then one
rank alone sets a variable to a value it can't use (UNUSABLE): it raises, and the others name it.

Prints `CASE <name> rank <r>: <ExceptionType>: <message>` (or `made`), `UNUSABLE <name> rank <r>: ...`
likewise, then, on a group every rank agrees on, `AFTER <transport> rank <r>: <the sum's wrong
elements>`; check() reads that output (tests/test_faults.py, tests/test_launchers.py)."""

import os

# name: (transport (None: ENGINE_TRANSPORT's), variable, rank 0's value)
CASES = {"shm two-shot step": ("shm", "ENGINE_SHM_CHUNK_BYTES", "131072"),
         "shm threshold": ("shm", "ENGINE_SHM_ONESHOT_MAX_BYTES", "1024"),
         "shm forced algorithm": ("shm", "ENGINE_ALLREDUCE_ALGO", "ring"),
         "a forced algorithm for CUDA tensors": ("shm", "ENGINE_ALLREDUCE_ALGO", "nccl:ring"),
         "the transport of CUDA tensors": ("shm", "ENGINE_CUDA_TRANSPORT", "staged"),
         "shm debug mode": ("shm", "ENGINE_DEBUG", "1"),
         "shm levels": ("shm", "ENGINE_HIER", "off"),
         "shm sockets": ("shm", "ENGINE_SOCKETS", "1"),
         "shm threads of one socket": ("shm", "ENGINE_THREADS", "2"),
         "shm a rank's own thread slices": ("shm", "ENGINE_SHM_THREAD_SLICE_BYTES", "4096"),
         "the transport": (None, "ENGINE_TRANSPORT", "tcp"),
         "what carries bytes between hosts": ("shm", "ENGINE_INTERHOST", "tcp"),
         "tcp ring segment": ("tcp", "ENGINE_RING_SEGMENT_BYTES", "65536"),
         "tcp connections": ("tcp", "ENGINE_TCP_CONNECT", "lazy"),
         "tcp tuning file missing on one rank": ("tcp", "ENGINE_TUNING_FILE", "/nonexistent/tuned.json"),
         "mpi tags": ("mpi", "ENGINE_MPI_TAG_UB", "32767"),
         "mpi any-source receives": ("mpi", "ENGINE_MPI_ANY_SOURCE", "probe"),
         "mpi native pieces": ("mpi", "ENGINE_MPI_CHUNK_ELEMENTS", "1000"),
         # (a fused call's buckets: under mpi:native, ranks that cut them differently summed blocks of
         # different counts, a wrong sum on one rank)
         "fusion buckets": ("shm", "ENGINE_BUCKET_BYTES", "1024"),
         "fusion's tensors alone": ("mpi", "ENGINE_FUSION_DIRECT_BYTES", "0"),
         # (not a variable: rank 0 runs as another release of the engine, its engine.__version__)
         "another engine release": (None, "engine.__version__", "0.0.1")}

# name: (transport, variable, a value one rank alone sets and can't use, that rank, what every rank
# sets). It raises its own error; the others name it, where before they waited for it for ever in
# an exchange it never reached, or read another exchange's data as that one's.
UNUSABLE = {"tcp streams": ("tcp", "ENGINE_TCP_STREAMS", "99", 1, {}),
            "tcp interface missing on one host": ("tcp", "ENGINE_SOCKET_IFNAME", "nosuch0", 1, {}),
            "shm slot size": ("shm", "ENGINE_SHM_SLOT_BYTES", "lots", 1, {}),
            "shm slot too small to create": ("shm", "ENGINE_SHM_SLOT_BYTES", "16", 0, {}),
            "shm single copy mode": ("shm", "ENGINE_SHM_CMA", "sometimes", 1, {}),
            "shm two-shot step": ("shm", "ENGINE_SHM_CHUNK_BYTES", "big", 1, {}),
            "shm threads": ("shm", "ENGINE_THREADS", "-1", 1, {}),
            "shm forced threads without threads": ("shm", "ENGINE_THREADS", "1", 1,
                                                   {"ENGINE_THREADS": "2", "ENGINE_ALLREDUCE_ALGO": "shm:twoshot_threads",
                                                    "ENGINE_HIER": "off"}),   # (a stage leaves it out)
            "shm spin budget": ("shm", "ENGINE_SPIN_US", "fast", 1, {}),
            "shm flight recorder": ("shm", "ENGINE_FLIGHT_RECORDER_SIZE", "0", 1, {}),
            "shm trace file": ("shm", "ENGINE_TRACE", "/nonexistent/trace.json", 1, {}),
            "fusion bucket cap": ("tcp", "ENGINE_BUCKET_BYTES", "lots", 1, {}),
            "mpi tags": ("mpi", "ENGINE_MPI_TAG_UB", "many", 1, {})}


def check(out, mpi):
    """Asserts what every rank of 4 printed (mpi: launched by mpiexec, else torchrun)."""
    import re
    group = r"(?:'world'|'\d+')"
    found = {"CASE": {}, "UNUSABLE": {}}
    # (each line to the next one's start: two ranks' lines may come joined)
    for kind, name, rank, what in re.findall(r"(CASE|UNUSABLE) (.+?) rank (\d): (.*?)(?=CASE |UNUSABLE |AFTER |$)",
                                             out, re.M):
        found[kind].setdefault(name, {})[int(rank)] = what
    for kind, wanted in (("CASE", CASES), ("UNUSABLE", UNUSABLE)):
        wanted = {n for n, (t, *_) in wanted.items() if mpi or t != "mpi"}
        assert set(found[kind]) == wanted and all(sorted(r) == [0, 1, 2, 3] for r in found[kind].values()), found
    for name, ranks in found["CASE"].items():
        _, var, value = CASES[name]
        if name == "shm threads of one socket":   # the plans differ (before any stage is made)
            assert all(re.match(rf"RuntimeError: engine: the ranks of group {group} would choose algorithms differently "
                                r"\(allreduce: rank 0 walks twoshot_threads\[\d+,any,1,any\], rank 1 does not; .*\): "
                                r"ENGINE_THREADS=2 on rank 0, unset on rank 1: set it alike", what)
                       for what in ranks.values()), ranks
        elif name == "shm a rank's own thread slices":
            assert set(ranks.values()) == {"made, 0 wrong"}, ranks
        elif name == "tcp tuning file missing on one rank":
            assert value in ranks[0] and "rank 0" not in ranks[0], ranks
            told = rf"RuntimeError: engine: group {group} was not made: rank 0 could not read its settings \("
            assert all(re.match(told, ranks[r]) and value in ranks[r] for r in (1, 2, 3)), ranks
        else:   # (the other ranks' value as the variable's, where the group reads one of its own: MPI's)
            theirs = {"ENGINE_MPI_TAG_UB": "unset", "ENGINE_MPI_ANY_SOURCE": "post"}.get(var, "")
            for what in ranks.values():
                assert re.match(rf"RuntimeError: engine: the ranks of group {group} have different settings "
                                rf"\({var}={value} on rank 0, {theirs}", what), (name, what)
    # A value one rank can't use (read before the group's first exchange, where it opens its end, or
    # where it chooses its algorithms): it raises its own error; the others name it (or, on the other
    # host, the rank whose stage failed), where before they waited for it for ever or read another
    # exchange's data as their own (`not enough values to unpack`).
    for name, ranks in found["UNUSABLE"].items():
        _, var, value, setter, _ = UNUSABLE[name]
        assert (var in ranks[setter] or value in ranks[setter]) and "was not made" not in ranks[setter], (name, ranks)
        for r in set(ranks) - {setter}:
            assert re.match(rf"RuntimeError: engine: group '(?:world|\d+)(?:/\w+)?' was not made: rank \d could not ",
                            ranks[r]) \
                and (var in ranks[r] or value in ranks[r]), (name, ranks)
    transports = ["shm", "tcp", "mpi"] if mpi else ["shm", "tcp"]
    assert sorted(re.findall(r"AFTER (\w+) rank \d: 0 wrong", out)) == sorted(transports * 4), out[-3000:]


def main():
    import numpy as np

    import engine

    if "TORCHELASTIC_RUN_ID" in os.environ:
        launcher, transports = torch_groups(), ("shm", "tcp")
    else:
        launcher, transports = engine_groups(), ("shm", "tcp", "mpi")
    R, P, make, allreduce, free = launcher

    def allreduce_errors(group, n=1 << 18):
        x = np.arange(n, dtype=np.float32) % 1000 + R
        out = allreduce(group, x)
        return int((out != P * (np.arange(n, dtype=np.float32) % 1000) + P * (P - 1) // 2).sum())

    cases = [("CASE", name, (transport, var, value, 0, {})) for name, (transport, var, value) in CASES.items()]
    cases += [("UNUSABLE", name, case) for name, case in UNUSABLE.items()]
    for label, name, (transport, var, value, setter, everywhere) in cases:
        if transport not in (None, *transports):
            continue
        saved = {k: os.environ.get(k) for k in (var, *everywhere)}
        os.environ.update(everywhere)
        release = engine.__version__
        if R == setter and var == "engine.__version__":
            engine.__version__ = value
        elif R == setter:
            os.environ[var] = value
        try:
            group = make(transport)
            print(f"{label} {name} rank {R}: made, {allreduce_errors(group)} wrong", flush=True)
            free(group)
        except Exception as exc:
            print(f"{label} {name} rank {R}: {type(exc).__name__}: {exc}", flush=True)
        engine.__version__ = release
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    for transport in transports:
        group = make(transport)
        print(f"AFTER {transport} rank {R}: {allreduce_errors(group)} wrong", flush=True)
        free(group)


def engine_groups():
    """(rank, size, make(transport), allreduce(group, array), free(group)) under mpiexec."""
    import numpy as np

    import engine
    from mpi4py import MPI

    def allreduce(comm, x):
        out = np.empty_like(x)
        comm.allreduce(x, out)
        return out
    return (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(),
            lambda transport: engine.Communicator(transport=transport, timeout=20), allreduce, lambda comm: comm.free())


def torch_groups():
    """The same under torchrun: each group a new_group(backend="engine") of a gloo world, made through
    torch's store; the transport asked for in ENGINE_TRANSPORT, as a torch job asks."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import torchbridge  # noqa: F401  (registers the backend)
    dist.init_process_group("gloo")

    def make(transport):
        before = os.environ.get("ENGINE_TRANSPORT")
        if transport is not None:
            os.environ["ENGINE_TRANSPORT"] = transport
        try:
            return dist.new_group(backend="engine", timeout=timedelta(seconds=20))
        finally:
            if transport is not None and before is None:
                del os.environ["ENGINE_TRANSPORT"]
            elif transport is not None:
                os.environ["ENGINE_TRANSPORT"] = before

    def allreduce(group, x):
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t, group=group)
        return t.numpy()
    return dist.get_rank(), dist.get_world_size(), make, allreduce, dist.destroy_process_group


if __name__ == "__main__":
    main()
