"""ENGINE_TUNING_FILE: rules and thresholds measured on this machine by `python -m engine.bench tune`,
read at start, in the spirit of Open MPI's dynamic rules file and NCCL's tuner plugins.

The file is JSON:

    {"format": "engine-tuning/2",
     "rules": {"allreduce": {"shm": [{"algorithm": "oneshot", "min_bytes": 0, "max_bytes": 98303,
                                      "min_ranks": 2, "max_ranks": 2}, ...],
                             "mpi": [...]}, ...},
     "thresholds": {"ENGINE_HIER_ALLREDUCE_MIN_BYTES": 16384, ...},     (optional)
     "measured_on": {...}, "timings_us": {...}}                          (what the tuner saw; not read)

A group walks the rules of its transport ahead of the registry's own (first match wins), so group
sizes the tuner did not measure keep the defaults; a rule naming an entry the group can't run (a
hierarchical one on a group within one host) is passed over. "thresholds" replace the registry's
defaults (engine.registry.Tunable); the environment still wins over both, as ENGINE_<COLLECTIVE>_ALGO
wins over the rules. Version-1 files ("allreduce": {transport: rules}, "hierarchical_allreduce_min_bytes")
are read too.
"""

import json
import os

FORMAT = "engine-tuning/2"
FORMATS = ("engine-tuning/1", FORMAT)
_cache = {}


def _fail(path, what):
    return ValueError(f"ENGINE_TUNING_FILE={path}: {what}; write a new one with "
                      "`mpirun -n <ranks> python -m engine.bench tune -o <file>`")


def load(path=None):
    """The validated tuning file named by ENGINE_TUNING_FILE (or path), or None when there is none:
    {"rules": {collective: {transport: [(name, lo, hi, min_ranks, max_ranks)]}}, "thresholds": {env: int}}."""
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
    if not isinstance(doc, dict) or doc.get("format") not in FORMATS:
        raise _fail(path, f"not an engine tuning file (expected \"format\": \"{FORMAT}\")")
    from . import registry
    if doc["format"] == FORMATS[0]:
        rules = {"allreduce": doc.get("allreduce", {})}
        hier = doc.get("hierarchical_allreduce_min_bytes")
        thresholds = {} if hier is None else {registry.HIER_MIN["allreduce"].env: hier}
    else:
        rules, thresholds = doc.get("rules", {}), doc.get("thresholds", {})
    if not isinstance(rules, dict):
        raise _fail(path, "\"rules\" must map a collective to {transport: [rules]}")
    parsed = {}
    for coll, per_transport in rules.items():
        if coll not in registry.COLLECTIVES:
            raise _fail(path, f"unknown collective {coll!r} (expected one of {', '.join(registry.COLLECTIVES)})")
        if not isinstance(per_transport, dict):
            raise _fail(path, f"rules.{coll} must map a transport to a list of rules")
        for transport, items in per_transport.items():
            if transport not in registry.TRANSPORTS:
                raise _fail(path, f"unknown transport {transport!r} (expected one of {', '.join(registry.TRANSPORTS)})")
            if not isinstance(items, list) or len(items) > registry.MAX_TUNED_RULES:
                raise _fail(path, f"{coll}.{transport} must be a list of at most {registry.MAX_TUNED_RULES} rules")
            parsed[coll, transport] = [_rule(path, coll, transport, i, e) for i, e in enumerate(items)]
    if not isinstance(thresholds, dict):
        raise _fail(path, "\"thresholds\" must map an environment variable to a byte count")
    known = {t.env for t in registry.tunables()}
    for name, value in thresholds.items():
        if name not in known:
            raise _fail(path, f"unknown threshold {name!r} (the registry's: {', '.join(sorted(known))})")
        if not isinstance(value, int) or value < 0:
            raise _fail(path, f"threshold {name} must be an integer >= 0, not {value!r}")
    _cache[path] = {"rules": parsed, "thresholds": dict(thresholds)}
    return _cache[path]


def _rule(path, coll, transport, i, item):
    from . import registry
    where = f"{coll}.{transport}[{i}]"
    if not isinstance(item, dict):
        raise _fail(path, f"{where} must be an object")
    names = [e.name for e in registry.entries(coll, transport)]
    algo = item.get("algorithm")
    if algo not in names:
        raise _fail(path, f"{where}: algorithm {algo!r} does not run on the {transport} transport "
                          f"(its {coll} runs {', '.join(names)})")
    values = []
    for key, default in (("min_bytes", 0), ("max_bytes", None), ("min_ranks", 1), ("max_ranks", None)):
        v = item.get(key, default)
        v = registry.EVERY if v is None else v
        if not isinstance(v, int) or v < 0:
            raise _fail(path, f"{where}: {key} must be an integer >= 0, not {v!r}")
        values.append(v)
    if values[0] > values[1] or values[2] > values[3]:
        raise _fail(path, f"{where}: an empty range (min above max)")
    return (algo, *values)


def rules(collective, transport):
    """This collective's rules on this transport from the tuning file (an empty list without one)."""
    doc = load()
    return list(doc["rules"].get((collective, transport), ())) if doc else []


def threshold(env, default):
    """A threshold from the tuning file, else default."""
    doc = load()
    return doc["thresholds"].get(env, default) if doc else default
