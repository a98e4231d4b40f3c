"""A suite in which rank 1 fails an assertion (run by tests/test_mpi_suites.py under mpiexec, as every
suite runs): the other ranks, left waiting in the next collective, must fail within seconds too, and
the assertion's message must be in the output."""

import numpy as np

import engine

WORLD = engine.world()


def test_rank_one_fails():
    x = np.ones(4, np.float32)
    WORLD.allreduce(x)
    assert WORLD.rank != 1, "rank 1 fails on purpose"


def test_the_others_wait_for_it():
    x = np.ones(4, np.float32)
    WORLD.allreduce(x)  # rank 1 stopped at its failure: the others wait here
