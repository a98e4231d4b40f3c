"""ENGINE_TUNING_FILE: rules and thresholds measured on this machine by `python -m engine.bench tune`,
read at start, in the spirit of Open MPI's dynamic rules file and NCCL's tuner plugins.

The file is JSON:

    {"format": "engine-tuning/2",
     "rules": {"allreduce": {"shm": [{"algorithm": "oneshot", "min_bytes": 0, "max_bytes": 98303,
                                      "min_ranks": 2, "max_ranks": 2}, ...],
                             "mpi": [...]}, ...},
     "thresholds": {"ENGINE_HIER_ALLREDUCE_MIN_BYTES": 16384, ...},     (optional)
     "measured_on": {...}, "timings_us": {...}}                          (what the tuner saw; not read)

This module reads the file's shape only: it knows no algorithm, transport or threshold. The registry
(engine.registry.tuned) checks the names against its tables, and a group walks the rules of its
transport ahead of the registry's own (first match wins), so group sizes the tuner did not measure
keep the defaults; a rule naming an entry the group can't run (a hierarchical one on a group within
one host) is passed over. "thresholds" replace the registry's defaults (engine.registry.Tunable);
the environment still wins over both, as ENGINE_<COLLECTIVE>_ALGO wins over the rules. Version-1
files ("allreduce": {transport: rules}, "hierarchical_allreduce_min_bytes") are read too.
"""

import json
import os
import stat

from .config import MAX_SETTING

FORMAT = "engine-tuning/2"
FORMATS = ("engine-tuning/1", FORMAT)
MAX_RULES = 32                  # per collective and transport


def fail(path, what):
    return ValueError(f"ENGINE_TUNING_FILE={path}: {what}; write a new one with "
                      "`mpirun -n <ranks> python -m engine.bench tune -o <file>`")


def parse(path):
    """{"rules": {(collective, transport): [(algorithm, min_bytes, max_bytes, min_ranks, max_ranks)]},
    "thresholds": {env: int}} from the file at path, its shape checked; None is an open upper bound."""
    try:
        # (opened without blocking and read only where a regular file: a FIFO would block, /dev/zero never end)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd) as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise fail(path, "not a regular file")
            doc = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"ENGINE_TUNING_FILE={path} does not exist; write one with "
                                "`mpirun -n <ranks> python -m engine.bench tune -o <file>`, or unset it") from None
    except json.JSONDecodeError as exc:
        raise fail(path, f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") not in FORMATS:
        raise fail(path, f"not an engine tuning file (expected \"format\": \"{FORMAT}\")")
    if doc["format"] == FORMATS[0]:
        rules = {"allreduce": doc.get("allreduce", {})}
        hier = doc.get("hierarchical_allreduce_min_bytes")
        thresholds = {} if hier is None else {"ENGINE_HIER_ALLREDUCE_MIN_BYTES": hier}
    else:
        rules, thresholds = doc.get("rules", {}), doc.get("thresholds", {})
    if not isinstance(rules, dict):
        raise fail(path, "\"rules\" must map a collective to {transport: [rules]}")
    parsed = {}
    for coll, per_transport in rules.items():
        if not isinstance(per_transport, dict):
            raise fail(path, f"rules.{coll} must map a transport to a list of rules")
        for transport, items in per_transport.items():
            if not isinstance(items, list) or len(items) > MAX_RULES:
                raise fail(path, f"{coll}.{transport} must be a list of at most {MAX_RULES} rules")
            parsed[coll, transport] = [_rule(path, f"{coll}.{transport}[{i}]", e) for i, e in enumerate(items)]
    if not isinstance(thresholds, dict):
        raise fail(path, "\"thresholds\" must map an environment variable to a byte count")
    for name, value in thresholds.items():
        if not _count(value):
            raise fail(path, f"threshold {name} must be an integer 0..{MAX_SETTING}, not {value!r}")
    return {"rules": parsed, "thresholds": dict(thresholds)}


def _rule(path, where, item):
    if not isinstance(item, dict):
        raise fail(path, f"{where} must be an object")
    values = [item.get("algorithm")]
    for key, default in (("min_bytes", 0), ("max_bytes", None), ("min_ranks", 1), ("max_ranks", None)):
        v = item.get(key, default)
        if v is not None and not _count(v):
            raise fail(path, f"{where}: {key} must be an integer 0..{MAX_SETTING}, not {v!r}")
        values.append(v)
    _, lo, hi, lo_r, hi_r = values
    if (hi is not None and lo > hi) or (hi_r is not None and lo_r > hi_r):
        raise fail(path, f"{where}: an empty range (min above max)")
    return tuple(values)


def _count(v):
    """Whether v is a byte or rank count the core takes (JSON's true is no count)."""
    return type(v) is int and 0 <= v <= MAX_SETTING
