"""Mutation check of the schedules, the step primitives and the selection: each mutant alone, in a
scratch checkout (never this one), is built, then timed to its first failure in tests/test_schedules.py
and in the conformance matrix (shared memory, or the mutant's transport, 3 ranks or the mutant's, under
mpiexec, with the mutant's settings), then reverted.

    git worktree add ../mut HEAD
    python tests/mutants.py ../mut            # every mutant; or name some: ../mut M1 M4
"""
import os
import subprocess
import sys
import time

MUT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else sys.exit(__doc__)
PY = sys.executable
MUTANTS = [
    ("M1 schedule: ring receives the block it sends", "pyx/schedule.pxd",
     "    return mod(rank - step - 1, nranks)", "    return mod(rank - step, nranks)"),
    ("M2 schedule: block_range drops an element of the last long block", "pyx/schedule.pxd",
     "    length[0] = base + (1 if b < extra else 0)", "    length[0] = base + (1 if b + 1 < extra else 0)"),
    ("M3 schedule: recursive doubling pairs a folded rank with the wrong peer", "pyx/schedule.pxd",
     "    return np_ * 2 + 1 if np_ < rem else np_ + rem", "    return np_ * 2 if np_ < rem else np_ + rem"),
    ("M4 primitive: exchange reads a per-receiver piece at the sender's slot", "pyx/shm_collectives.pxi",
     "self.seg.half(q, self.seg.step) + (0 if shared else r * per * isz), m * isz)",
     "self.seg.half(q, self.seg.step) + (0 if shared else q * per * isz), m * isz)"),
    ("M5 primitive: the Mover's store drops a block's last element", "pyx/shm_collectives.pxi",
     "        eng_team_copy(tm, mv.dst + off * mv.wsz, frm, n * mv.wsz)",
     "        eng_team_copy(tm, mv.dst + off * mv.wsz, frm, (n - (n > 1)) * mv.wsz)"),
    ("M6 selection: a rule's lower byte bound made exclusive", "pyx/comm.pxi",
     "            if (r.lo <= nbytes <= r.hi and", "            if (r.lo < nbytes <= r.hi and"),
    ("M7 AVG: divided twice (the matrix over TCP)", "pyx/comm.pxi",
     "self.rank == c.root)):\n            avg_after(c, self.size, spread)\n",
     "self.rank == c.root)):\n            avg_after(c, self.size, spread)\n"
     "            avg_after(c, self.size, spread)\n",
     "tcp"),
    ("M8 point-to-point ring: allgather receives a block off by one (forced over shared memory)",
     "pyx/p2p_collectives.pxi",
     "dst + displs[rb] * isz, counts[rb] * isz, (r - 1 + P) % P, TAG_P2P_ALLGATHER, ctx)",
     "dst + displs[(rb + 1) % P] * isz, counts[rb] * isz, (r - 1 + P) % P, TAG_P2P_ALLGATHER, ctx)"),
    ("M9 threads: the second thread of a rank's team skips its slice (4 threads a rank)", "pyx/team.h",
     "  if (h->index >= j->parts) return;", "  if (h->index >= j->parts || h->index == 1) return;",
     "shm", {"ENGINE_THREADS": "4"}),
    ("M10 composite AVG: the core divides a hierarchy's sum only after it (two forced sockets)", "pyx/comm.pxi",
     "                spread = avg_before(c, self.rank, self.size, &self.avg_input, &self.avg_input_bytes)\n",
     "                spread = 0.0\n",
     "shm", {"ENGINE_SOCKETS": "2"}, 4),
    ("M11 hierarchy: allgather puts each block back host-major (two forced sockets)", "pyx/hierarchy.pxi",
     "memcpy(c.dst + g * blk, both + (i * H + h) * blk, blk)", "memcpy(c.dst + g * blk, both + (h * L + i) * blk, blk)",
     "shm", {"ENGINE_SOCKETS": "2"}, 4),
]
only = sys.argv[2:]
env = {**os.environ, "PYTHONPATH": MUT, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
for name, path, old, new, *where in MUTANTS:
    transport = where[0] if where else "shm"
    extra_env = where[1] if len(where) > 1 else {}
    nranks = where[2] if len(where) > 2 else 3
    if only and name.split()[0] not in only:
        continue
    p = os.path.join(MUT, path)
    src = open(p).read()
    assert src.count(old) == 1, (name, src.count(old))
    open(p, "w").write(src.replace(old, new))
    try:
        b = subprocess.run([PY, "setup.py", "build_ext", "--inplace"], cwd=MUT, capture_output=True, text=True)
        assert b.returncode == 0, b.stderr[-3000:]
        row = [name]
        for label, cmd in (("schedules", [PY, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_schedules.py"]),
                           (f"matrix {transport}-{nranks}", [PY, "tests/mpirun.py", str(nranks), "tests/mpi/test_matrix.py"])):
            t = time.monotonic()
            r = subprocess.run(cmd, cwd=MUT, env={**env, "ENGINE_TRANSPORT": transport, "ENGINE_TIMEOUT": "10", **extra_env},
                               capture_output=True, text=True, timeout=900)
            dt = time.monotonic() - t
            failed = [l for l in (r.stdout + r.stderr).splitlines() if l.startswith(("FAILED", "[1,0]<stdout>: FAILED", "[1,1]<stdout>: FAILED", "[1,2]<stdout>: FAILED"))][:1]
            row.append(f"{label}: {'caught' if r.returncode else 'NOT caught'} in {dt:.1f} s {failed[0][:160] if failed else ''}")
        print(" | ".join(row), flush=True)
    finally:
        open(p, "w").write(src)
subprocess.run([PY, "setup.py", "build_ext", "--inplace"], cwd=MUT, capture_output=True)
