"""all_reduce of a sparse COO tensor, which the engine's dense collectives carry in three allgathers."""

import math

import torch

from engine import DTYPE_NAMES

from .devices import write_back


def uneven(counts):
    """counts, or None where every rank's is the same (the engine's even form)."""
    return None if len(set(counts)) <= 1 else counts


def _dtype_code(dtype):
    """dtype's code among the engine's dtypes (-1: one it does not move, which the allgathers refuse)."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.index(name) if name in DTYPE_NAMES else -1


def _dtype_name(code):
    return f"torch.{DTYPE_NAMES[code]}" if 0 <= code < len(DTYPE_NAMES) else "one the engine does not move"


def sparse_sum(t, comm):
    """all_reduce (SUM) of a sparse COO tensor as Gloo does it: every rank's coalesced indices and values
    are gathered, concatenated in rank order and summed by coalescing; the sum is written into t."""
    mine = t.coalesce()
    indices, values = mine.indices(), mine.values()
    meta = torch.tensor([mine._nnz(), mine.sparse_dim(), mine.dim(), hash(tuple(mine.shape)), _dtype_code(t.dtype)],
                        dtype=torch.int64)
    metas = torch.empty(comm.size * meta.numel(), dtype=torch.int64)
    comm.allgather(meta, metas)
    metas = metas.view(comm.size, -1)
    if not bool((metas[:, 1:] == meta[1:]).all()):
        differ = [r for r in range(comm.size) if not bool((metas[r, 1:] == meta[1:]).all())]
        raise ValueError(f"engine all_reduce of a sparse tensor: ranks {', '.join(map(str, differ))} passed a "
                         f"sparse tensor of another shape, sparse dimension or dtype than this rank's "
                         f"{tuple(t.shape)} {t.dtype} with {mine.sparse_dim()} sparse dimensions (their dtypes: "
                         f"{', '.join(f'rank {r} ' + _dtype_name(int(metas[r, 4])) for r in differ)})")
    counts = metas[:, 0].tolist()
    most = math.prod(t.shape[:mine.sparse_dim()])   # (a coalesced tensor's entries: one per index at most)
    bad = [r for r, n in enumerate(counts) if not 0 <= n <= most]
    if bad:
        raise RuntimeError(f"engine all_reduce of a sparse tensor: rank {bad[0]} announced {counts[bad[0]]} entries, "
                           f"where a coalesced {tuple(t.shape)} tensor with {mine.sparse_dim()} sparse dimensions "
                           f"holds 0 to {most}: a rank of another engine, or corrupt data, is in the group")
    total = sum(counts)
    if total == 0:
        write_back(t, mine)
        return
    row = math.prod(values.shape[1:])
    all_indices = indices.new_empty(total, indices.shape[0])  # rank-major: each rank's block is contiguous
    comm.allgather(indices.t().contiguous(), all_indices, uneven([n * indices.shape[0] for n in counts]))
    all_values = values.new_empty((total,) + tuple(values.shape[1:]))
    comm.allgather(values.contiguous(), all_values, uneven([n * row for n in counts]))
    write_back(t, torch.sparse_coo_tensor(_checked(all_indices, counts, t.shape), all_values, t.shape,
                                          check_invariants=False).coalesce())


def _checked(all_indices, counts, shape):
    """The gathered indices (one row an entry, rank-major) as torch takes them, each checked against the
    shape: one out of range, from a peer, would be written out of bounds."""
    limits = torch.tensor(shape[:all_indices.shape[1]], dtype=all_indices.dtype)
    bad = ((all_indices < 0) | (all_indices >= limits)).any(dim=1)
    if bool(bad.any()):
        at = int(bad.nonzero()[0, 0])
        rank = next(r for r in range(len(counts)) if at < sum(counts[:r + 1]))
        raise RuntimeError(f"engine all_reduce of a sparse tensor: rank {rank} sent the index "
                           f"{tuple(all_indices[at].tolist())}, outside the shape {tuple(shape)}: a rank of another "
                           "engine, or corrupt data, is in the group")
    return all_indices.t()
