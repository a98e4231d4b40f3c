"""Subgroups made while algorithms are forced (ENGINE_<COLLECTIVE>_ALGO), for the engine's own suites
under mpiexec (tests/mpi/test_collectives.py, tests/mpi/test_errors.py)."""

import os

import pytest


def forced_subgroup(world, ranks, transport=None, **algorithms):
    """world.subgroup(ranks) made while each collective=entry of algorithms is forced (for instance
    broadcast="shm:single_copy"); the test is skipped, on every rank alike, where the group lacks
    what an entry needs (single copy where ENGINE_SHM_CMA=0, as the tiny-segment suite sets)."""
    forced = {f"ENGINE_{collective.upper()}_ALGO": entry for collective, entry in algorithms.items()}
    before = {name: os.environ.get(name) for name in forced}
    os.environ.update(forced)
    try:
        return world.subgroup(list(ranks), transport=transport)
    except ValueError as exc:
        if "lacks" not in str(exc):
            raise
        pytest.skip(f"not here: {exc}")
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
