"""Environment variables that tune the engine, read in one place. Documented in README.md."""

import math
import os


# The largest count or size a setting takes (the registry's "no bound"): the compiled code keeps them
# in 64-bit fields, where a larger one would fail unnamed, or wrap.
MAX_SETTING = 1 << 62


def env_int(name, default, minimum=None, maximum=MAX_SETTING):
    """A count or a size (one K/M/G suffix), at least `minimum` where one is given, at most `maximum`."""
    raw = os.environ.get(name)
    text = (raw or "").strip()   # (as env_choice reads its words: '1K ' was refused where '64 ' passed)
    if not text:
        return default
    body, unit = (text[:-1], text[-1].lower()) if text[-1] in "kKmMgG" else (text, "")
    try:
        exact = float(body) * {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(unit, 1)
        value = int(exact)
    except (ValueError, OverflowError):   # (inf, nan)
        raise ValueError(f"{name}={raw!r} is not a number (sizes accept K/M/G suffixes)") from None
    if value != exact:   # (2.9 threads were 2)
        raise ValueError(f"{name}={raw!r}: expected a whole number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={raw!r}: expected at least {minimum}")
    if value > maximum:
        raise ValueError(f"{name}={raw!r}: expected at most {maximum}")
    return value


FLAG_VALUES = {"": False, "0": False, "false": False, "no": False, "off": False,
               "1": True, "true": True, "yes": True, "on": True}


def env_flag(name):
    """An on/off setting: 1, true, yes, on; or 0, false, no, off, unset (ENGINE_DEBUG=false was on)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw not in FLAG_VALUES:
        raise ValueError(f"{name}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")
    return FLAG_VALUES[raw]


def env_choice(name, choices, default):
    raw = os.environ.get(name, "").strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


# What "no limit" (a timeout of inf) becomes where a wait takes a finite length (a store's wait, a
# thread's join): about 31 years.
FOREVER_SECONDS = 1e9


def finite_seconds(seconds):
    return min(seconds, FOREVER_SECONDS)


def seconds_given(value, what, positive=False):
    """A duration given as an argument, in seconds (inf: never): a number >= 0, not NaN, as env_duration's
    (positive: > 0, as there)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"{what} must be a number of seconds >= 0 (inf: never), got {value!r}")
    seconds = float(value)
    if not seconds >= 0:
        raise ValueError(f"{what} must be a number of seconds >= 0 (inf: never), got {value!r}")
    if positive and seconds == 0:
        raise ValueError(f"{what} of 0 would time every call out at once; give seconds > 0 (inf: no limit)")
    return seconds


def env_duration(name, default, unit="seconds", maximum=math.inf, positive=False):
    """A duration (inf: never, where maximum allows it); a negative value or NaN would turn a timeout
    into a wait that never ends, so they are refused here, naming the variable. positive: 0 is refused
    too (a timeout of 0 ends every wait at once)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise ValueError(f"{name}={raw!r} is not a number of {unit} >= 0")
    if positive and value == 0:
        raise ValueError(f"{name}={raw!r}: every call would time out at once; give {unit} > 0 (inf: no limit)")
    if value > maximum:
        raise ValueError(f"{name}={raw!r}: expected at most {maximum:g} {unit}")
    return value


CUDA_TRANSPORTS = ("auto", "nccl", "staged")


def cuda_transport():
    """ENGINE_CUDA_TRANSPORT: how a group moves CUDA tensors (NCCL, through host memory, or the engine's
    choice); read when a group is made, so a typo is refused in a CPU-only job too."""
    return env_choice("ENGINE_CUDA_TRANSPORT", CUDA_TRANSPORTS, "auto")
