"""A process forked from a rank: what it keeps of the engine.

A fork (a DataLoader's workers, multiprocessing's fork start method, os.fork) copies the rank's memory
and descriptors, not its threads. The groups in that copy are the rank's: a message the child sent
would land in the rank's connections or its segment, a goodbye from the child's exit would tell the
rank's peers that the rank left, and the child's copy of a connection would keep it open after the
rank dies, hiding the death from the peers. So in the child:
- the TCP channels close their copies of every connection before anything runs (pyx/tcp.h, at the
  fork itself);
- every group refuses every call, naming the fork, and is never freed there (CoreComm.orphan): its
  memory goes with the child;
- the engine's exit hooks (goodbyes, MPI's abort, the trace's writing) don't run (at_exit).
A child that needs groups of its own makes them (init_process_group in a worker started by spawn).
"""

import atexit
import os
import weakref

_groups = weakref.WeakSet()  # every Communicator of this process, stages included
_exit_hooks = []             # what at_exit registered


def at_exit(fn, *args):
    """atexit.register(fn, *args), for this process only: a child forked from it doesn't run fn. A
    function registered again moves to the front (atexit runs the newest first)."""
    atexit.unregister(fn)
    atexit.register(fn, *args)
    if fn not in _exit_hooks:
        _exit_hooks.append(fn)


def track(group):
    """A group (an engine.Communicator) that a forked child must not use or free."""
    _groups.add(group)


def _in_child():
    for fn in _exit_hooks:
        atexit.unregister(fn)
    _exit_hooks.clear()
    for group in list(_groups):
        core = getattr(group, "_core", None)
        if core is not None:
            core.orphan(f"this process (pid {os.getpid()}) is a fork of rank {group.rank} (pid {os.getppid()}), "
                        f"which made group {group.name!r}; a group belongs to the process that made it: a forked "
                        "worker makes groups of its own (init_process_group) or leaves the collectives to its parent")
    _groups.clear()


os.register_at_fork(after_in_child=_in_child)
