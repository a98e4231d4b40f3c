"""ENGINE_TUNING_FILE: allreduce rules measured on this machine by `python -m engine.bench tune`, read at
start, in the spirit of Open MPI's dynamic rules file and NCCL's tuner plugins.

The file is JSON:

    {"format": "engine-tuning/1",
     "allreduce": {"shm": [{"algorithm": "oneshot", "min_bytes": 0, "max_bytes": 98303,
                            "min_ranks": 2, "max_ranks": 2}, ...],
                   "mpi": [...]},
     "hierarchical_allreduce_min_bytes": 16384,          (optional: groups spanning hosts)
     "measured_on": {...}, "timings_us": {...}}           (what the tuner saw; not read)

A group uses the rules of its transport ahead of the built-in ones (first match wins), so group sizes
the tuner did not measure keep the defaults. ENGINE_ALLREDUCE_ALGO (one algorithm for every size) and
ENGINE_HIER_ALLREDUCE_MIN_BYTES still win over the file.
"""

import json
import os

FORMAT = "engine-tuning/1"
MAX_RULES = 12
_cache = {}


def _fail(path, what):
    return ValueError(f"ENGINE_TUNING_FILE={path}: {what}; write a new one with "
                      "`mpirun -n <ranks> python -m engine.bench tune -o <file>`")


def load(path=None):
    """The validated tuning file named by ENGINE_TUNING_FILE (or path), or None when there is none."""
    path = path or os.environ.get("ENGINE_TUNING_FILE") or None
    if path is None:
        return None
    if path in _cache:
        return _cache[path]
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"ENGINE_TUNING_FILE={path} does not exist; write one with "
                                "`mpirun -n <ranks> python -m engine.bench tune -o <file>`, or unset it") from None
    except json.JSONDecodeError as exc:
        raise _fail(path, f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _fail(path, f"not an engine tuning file (expected \"format\": \"{FORMAT}\")")
    from .algorithms import ALGORITHMS
    rules = doc.get("allreduce", {})
    if not isinstance(rules, dict):
        raise _fail(path, "\"allreduce\" must map a transport to a list of rules")
    parsed = {}
    for transport, entries in rules.items():
        if transport not in ALGORITHMS:
            raise _fail(path, f"unknown transport {transport!r} (expected one of {', '.join(ALGORITHMS)})")
        if not isinstance(entries, list) or len(entries) > MAX_RULES:
            raise _fail(path, f"allreduce.{transport} must be a list of at most {MAX_RULES} rules (the core walks "
                              "16, the built-in ones take the rest)")
        parsed[transport] = [_rule(path, transport, i, e, ALGORITHMS[transport]) for i, e in enumerate(entries)]
    hier = doc.get("hierarchical_allreduce_min_bytes")
    if hier is not None and (not isinstance(hier, int) or hier < 0):
        raise _fail(path, f"hierarchical_allreduce_min_bytes must be a byte count >= 0, not {hier!r}")
    _cache[path] = {"allreduce": parsed, "hierarchical_allreduce_min_bytes": hier}
    return _cache[path]


def _rule(path, transport, i, entry, algorithms):
    where = f"allreduce.{transport}[{i}]"
    if not isinstance(entry, dict):
        raise _fail(path, f"{where} must be an object")
    algo = entry.get("algorithm")
    if algo not in algorithms:
        raise _fail(path, f"{where}: algorithm {algo!r} does not run on the {transport} transport "
                          f"(it runs {', '.join(algorithms)})")
    values = []
    for key, default in (("min_bytes", 0), ("max_bytes", None), ("min_ranks", 1), ("max_ranks", None)):
        v = entry.get(key, default)
        if v is None:
            from .algorithms import EVERY
            v = EVERY
        if not isinstance(v, int) or v < 0:
            raise _fail(path, f"{where}: {key} must be an integer >= 0, not {v!r}")
        values.append(v)
    if values[0] > values[1] or values[2] > values[3]:
        raise _fail(path, f"{where}: an empty range (min above max)")
    return (algo, *values)


def allreduce_rules(transport):
    """This transport's rules from the tuning file (an empty list without one)."""
    doc = load()
    return list(doc["allreduce"].get(transport, ())) if doc else []


def hierarchical_allreduce_min_bytes(default):
    doc = load()
    value = doc and doc["hierarchical_allreduce_min_bytes"]
    return default if value is None else value
