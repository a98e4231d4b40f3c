"""A process forked from a rank: what it keeps of the engine.

A fork (a DataLoader's workers, multiprocessing's fork start method, os.fork) copies the rank's memory
and descriptors, not its threads. The groups in that copy are the rank's: a message the child sent
would land in the rank's connections or its segment, a goodbye from the child's exit would tell the
rank's peers that the rank left, and the child's copy of a connection would keep it open after the
rank dies, hiding the death from the peers. So in the child:
- the TCP channels close their copies of every connection before anything runs (pyx/tcp.h, at the
  fork itself);
- everything that owns a group's threads or shared state (tracked here: the groups, their progress
  threads, the fusion's helper, the CUDA communicators, the store lines) is orphaned: its calls are
  refused, naming the fork, and it frees nothing there (its memory goes with the child);
- no group is made through what the child inherited (MPI, or a group's store);
- the exit hooks that act for the rank's process alone (MPI's abort, the trace's writing) don't run
  there (at_exit); the others act on what is live, and the orphans in that are inert.
"""

import atexit
import os
import sys
import weakref

ADVICE = ("a group belongs to the process that made it: a forked worker can't use the groups that came with the "
          "fork (one that needs groups of its own starts with multiprocessing's 'spawn' method and makes them)")

_owned = weakref.WeakSet()   # what orphan(why) makes inert in a child
_exit_hooks = []             # what at_exit registered
_inherited = {}              # in a child: "why", the groups' base "stores", whether "mpi" came with the fork


def at_exit(fn, *args):
    """atexit.register(fn, *args), for this process only: a child forked from it doesn't run fn. A
    function registered again moves to the front (atexit runs the newest first)."""
    atexit.unregister(fn)
    atexit.register(fn, *args)
    if fn not in _exit_hooks:
        _exit_hooks.append(fn)


def track(obj):
    """obj.orphan(why) runs in every child forked from this process (why: a sentence naming the fork)."""
    _owned.add(obj)


def base_store(store):
    """The store under torch's PrefixStores: one connection, whatever the prefixes over it."""
    while getattr(store, "underlying_store", None) is not None:
        store = store.underlying_store
    return store


def check_can_make(what, store=None, mpi=False):
    """Raises in a forked child where `what` (a group being made, a store protocol) would go through
    what it inherited: MPI (mpi: the group's bootstrap), or a store of its parent's groups."""
    if not _inherited:
        return
    if mpi and _inherited["mpi"]:
        raise RuntimeError(f"engine: {what}: {_inherited['why']}, and MPI came with the fork (MPI can't be used in a "
                           f"forked process); {ADVICE}")
    if store is not None and any(base_store(store) is s for s in _inherited["stores"]):
        raise RuntimeError(f"engine: {what}: {_inherited['why']}, and this store came with the fork (its groups' "
                           f"store); {ADVICE}")


def _in_child():
    for fn in _exit_hooks:
        atexit.unregister(fn)
    _exit_hooks.clear()
    why = f"this process (pid {os.getpid()}) is a fork of pid {os.getppid()}"
    owned = list(_owned)
    stores = [base_store(s) for s in (getattr(getattr(o, "watch", None), "store", None) for o in owned)
              if s is not None]
    MPI = sys.modules.get("mpi4py.MPI")
    mpi = MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()
    _inherited.update(why=why, stores=stores + _inherited.get("stores", []), mpi=mpi or _inherited.get("mpi", False))
    # the groups first: an orphan() that fails (a progress thread's task callbacks are the user's) must
    # not leave a group able to touch the parent's segment or connections
    for obj in sorted(owned, key=lambda o: not hasattr(o, "_core")):
        try:
            obj.orphan(why)
        except Exception as exc:
            print(f"engine: in a forked child, making {type(obj).__name__} inert failed: {exc!r}", file=sys.stderr,
                  flush=True)


os.register_at_fork(after_in_child=_in_child)
