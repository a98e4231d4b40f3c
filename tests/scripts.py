"""Runs several scripts one after another in one process, each as `python SCRIPT ARGS...` (or `python -m
MODULE ARGS...`) would run it alone: its own __main__ and sys.argv; a script that exits non-zero stops
the rest with its exit. One launch across hosts then runs several examples (tests/test_hosts.py): each
makes its process group and destroys it before the next begins.

    mpirun -n 2 python tests/scripts.py examples/check_collectives.py -- -m bench all_reduce -c 1
"""

import os
import runpy
import sys


def split(argv):
    """The scripts' command lines, separated by `--`."""
    jobs = [[]]
    for arg in argv:
        if arg == "--":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    return [job for job in jobs if job]


def run(job):
    saved = sys.argv
    try:
        if job[0] == "-m":
            if os.getcwd() not in sys.path:   # as `python -m` finds modules in the current directory
                sys.path.insert(0, os.getcwd())
            sys.argv = [job[1], *job[2:]]
            runpy.run_module(job[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(job)
            runpy.run_path(job[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        sys.argv = saved


if __name__ == "__main__":
    for job in split(sys.argv[1:]):
        run(job)
