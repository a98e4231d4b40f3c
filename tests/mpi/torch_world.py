"""The default process group on backend "engine" (created once per launch, whichever suite runs first)
and a Gloo group of the same ranks, to compare against."""

import contextlib
import os
from datetime import timedelta

import torch.distributed as dist

# The suites' short timeout (ENGINE_TIMEOUT): a torch group takes torch's own (30 min) otherwise, and a
# rank out of step would hold the whole run until then.
TIMEOUT = timedelta(seconds=float(os.environ.get("ENGINE_TIMEOUT", "1800")))
# The Gloo group's, which the suites' ranks meet on between steps: long enough for ranks whose peers wait
# out a test's own timeouts (30 s at most), short enough that the ranks left waiting on one that stopped
# (pytest -x, at a failure: under MPI it then waits in MPI_Finalize, its sockets open) fail, naming the
# barrier, well within their launch's timeout, instead of holding it for Gloo's 30 minutes.
GLOO_TIMEOUT = min(timedelta(seconds=120), TIMEOUT * 12)

_gloo = []


def init():
    """(rank, world size, Gloo group); no torchbridge import: torch's entry point registers the backend."""
    if not dist.is_initialized():
        dist.init_process_group(backend="engine")
    if not _gloo:
        _gloo.append(dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT))
    return dist.get_rank(), dist.get_world_size(), _gloo[0]


@contextlib.contextmanager
def engine_group(**env):
    """A new group of every rank on backend engine, made while these environment variables are set (the
    ENGINE_* settings a group reads when it is made), with the suites' timeout; destroyed at the end."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        pg = dist.new_group(backend="engine", timeout=TIMEOUT)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield pg, pg.communicator
    finally:
        dist.destroy_process_group(pg)
