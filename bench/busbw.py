"""nccl-tests' size conventions and bus-bandwidth factors (doc/PERFORMANCE.md), as pure functions."""

# pingpong: ranks 2k and 2k+1 trade one message with blocking send and recv (2k sends first); an
# unpaired last rank idles. Its time is that round trip: one send and one recv on each rank.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv", "pingpong",
               "barrier")
ROOTED = ("broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
# Collectives whose -b/-e size is the whole array (count x typesize x nranks), split across ranks.
WHOLE_ARRAY = ("all_gather", "reduce_scatter", "alltoall")


def busbw_factor(collective, nranks):
    n = nranks
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in WHOLE_ARRAY:
        return (n - 1) / n
    return 1.0


def per_rank_count(collective, nbytes, itemsize, nranks):
    """Elements in each rank's send buffer for a message of nbytes (0: too small to run)."""
    count = nbytes // itemsize
    if collective in ("all_gather",):
        return count // nranks  # each rank contributes 1/n of the whole array
    if collective in ("reduce_scatter", "alltoall"):
        return (count // nranks) * nranks  # the whole array, divisible in n blocks
    return count


def bytes_moved(collective, count, itemsize, nranks):
    """S of nccl-tests for a run with `count` elements per rank's send buffer."""
    if collective == "all_gather":
        return count * itemsize * nranks
    return count * itemsize


def bandwidths(collective, nbytes, seconds, nranks):
    """(algbw, busbw) in GB/s (1 GB = 1e9 bytes)."""
    if seconds <= 0 or collective == "barrier":
        return 0.0, 0.0
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * busbw_factor(collective, nranks)


def parse_size(text):
    """'8', '1K', '64M', '1G', '1.5k' -> bytes (binary multiples, as nccl-tests)."""
    s = str(text).strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    number = s[:-1] if mult > 1 else s
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"bad size {text!r}: use a number with an optional K, M or G suffix") from None
    if value < 0:
        raise ValueError(f"bad size {text!r}: negative")
    return int(value * mult)


def size_sweep(minbytes, maxbytes, factor):
    if factor <= 1:
        raise ValueError(f"step factor must be > 1, got {factor}")
    if maxbytes < minbytes:
        raise ValueError(f"max size {maxbytes} is below min size {minbytes}")
    sizes, s = [], max(minbytes, 1)
    while s <= maxbytes:
        sizes.append(s)
        s = int(s * factor) if int(s * factor) > s else s + 1
    return sizes


def format_size(nbytes):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return str(nbytes)
