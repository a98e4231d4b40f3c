"""nccl-tests-style tables per backend, the side-by-side ratio table, and the JSON file."""

import json
import statistics

from .busbw import COLLECTIVES

SCHEMA_VERSION = 1
ROW_KEYS = ("backend", "collective", "mode", "size", "count", "type", "redop", "root", "time_us", "algbw", "busbw",
            "wrong", "samples_us")
DESCRIPTIONS = {
    "engine": "torch.distributed, backend engine",
    "engine-async": "torch.distributed, backend engine, async_op=True then wait()",
    "engine-group": "torch.distributed, backend engine, a group of every rank made by new_group (as nop's)",
    "engine-interhost-tcp": "torch.distributed, backend engine, hosts talking over the engine's TCP (ENGINE_INTERHOST=tcp)",
    "engine-interhost-mpi": "torch.distributed, backend engine, hosts talking over MPI (ENGINE_INTERHOST=mpi)",
    "engine-direct": "engine.Communicator of the same group, no torch layer",
    "engine-shm": "engine.Communicator over shared memory, no torch layer",
    "engine-mpi": "engine.Communicator over MPI, no torch layer",
    "engine-tcp": "engine.Communicator over the engine's TCP transport, no torch layer",
    "nop": "torch.distributed, a do-nothing Python process group (torch's own share)",
    "nop+direct": "the do-nothing group's call, then engine-direct's, back to back (the torch call if the adapter added nothing)",
    "direct-group": "torch.distributed, a Python group that makes engine-direct's call and nothing more (a free adapter)",
    "gloo": "torch.distributed, Gloo group in the same job",
    "mpi4py": "raw mpi4py on numpy views of torch-allocated tensors",
    "nccl": "torch.distributed, backend nccl (CUDA)",
    "deepspeed-shm": "DeepSpeed's shared-memory allreduce, torch.ops.deepspeed.inference_all_reduce_",
}


def cpu_of(meta):
    """The CPU a run's numbers belong to, as its JSON recorded it."""
    if meta.get("cpu_model"):
        return meta["cpu_model"]
    return "CPU not named by /proc/cpuinfo" if "cpu_model" in meta else "CPU not recorded"


def timing(meta):
    """How a run's times were taken: runs before meta recorded it averaged each rank's mean over ranks."""
    return meta.get("timing", "each rank's mean per call averaged over ranks")


def _not_run(meta, collective, backend=None):
    return [x for x in meta.get("not_run", ()) if x["collective"] == collective and backend in (None, x["backend"])]


def _notes(refused):
    """{(backend, size, mode): footnote number} and the footnotes, one per backend and reason: why a
    cell is N/A where the backend refused the case (a bare N/A: the API has no such form)."""
    numbers, marks = {}, {}
    for x in refused:
        marks[(x["backend"], x["size"], x["mode"])] = numbers.setdefault((x["backend"], x["reason"]), len(numbers) + 1)
    return marks, [f"[{n}] {backend} refused: {reason}" for (backend, reason), n in numbers.items()]


def _cols(row, note=None):
    if row is None:
        return f"{'N/A' if note is None else f'N/A [{note}]':>10} {'':>7} {'':>7} {'':>6}"
    wrong = "N/A" if row["wrong"] < 0 else str(row["wrong"])
    return f"{row['time_us']:>10.2f} {row['algbw']:>7.2f} {row['busbw']:>7.2f} {wrong:>6}"


def backend_table(rows, backend, collective, meta):
    mine = [r for r in rows if r["backend"] == backend and r["collective"] == collective]
    refused = _not_run(meta, collective, backend)
    if not mine and not refused:
        return ""
    marks, footnotes = _notes(refused)
    forced = sorted({r["algorithm"] for r in mine if r.get("algorithm")})
    time = "round trip" if collective == "pingpong" else "time"   # a send and a recv each way
    lines = [f"# {collective} on {backend}: {DESCRIPTIONS.get(backend, backend)}, {meta['world_size']} ranks"
             + (" (oversubscribed)" if meta.get("oversubscribed") else "")
             + (f", allreduce algorithm {', '.join(forced)} forced" if forced else ""),
             f"# {'':>51} {'out-of-place':>32} {'in-place':>32}",
             f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
             f"{time:>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {time:>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}",
             f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>5} "
             f"{'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"]
    for size in sorted({r["size"] for r in mine + refused}):
        by_mode = {r["mode"]: r for r in mine if r["size"] == size}
        any_row = next(r for r in mine + refused if r["size"] == size)
        cols = [_cols(by_mode.get(mode), marks.get((backend, size, mode))) for mode in ("out-of-place", "in-place")]
        lines.append(f"  {size:>10} {any_row['count']:>12} {any_row['type']:>8} {any_row['redop']:>6} "
                     f"{any_row['root']:>5} {cols[0]} {cols[1]}")
    lines += [f"# {note}" for note in footnotes]
    if not mine:
        return "\n".join(lines)
    wrong = sum(max(r["wrong"], 0) for r in mine)
    checked = any(r["wrong"] >= 0 for r in mine)
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"
                 + ("" if checked else " (not checked: pass -c 1)"))
    lines.append(f"# Avg bus bandwidth    : {statistics.mean(r['busbw'] for r in mine):.4f}")
    return "\n".join(lines)


def _comparison(rows, collective, base, also=()):
    """(other backends, [(size, mode, base time, [each other's time or None])]) of one collective: the
    base backend (the first of --backends) beside the others (and beside `also`, which may have no
    row), same size and mode, from the same run."""
    mine = [r for r in rows if r["collective"] == collective]
    if not any(r["backend"] == base for r in mine):
        return [], []
    others = [b for b in dict.fromkeys([r["backend"] for r in mine] + list(also)) if b != base]
    index = {(r["backend"], r["size"], r["mode"]): r["time_us"] for r in mine}
    lines = [(size, mode, index[(base, size, mode)], [index.get((b, size, mode)) for b in others])
             for size in sorted({r["size"] for r in mine}) for mode in ("out-of-place", "in-place")
             if (base, size, mode) in index]
    return others, lines


def ratio_table(rows, collective, base):
    """The base backend's time over each other backend's (< 1: base faster), as text."""
    others, lines = _comparison(rows, collective, base)
    if not others:
        return ""
    out = [f"# {collective}: {base} time / other time, same run (< 1: {base} is faster)",
           f"# {'size':>10} {'mode':>13} {base + ' us':>14}" + "".join(f" {b + ' us':>14}" for b in others)
           + "".join(f" {base + '/' + b:>20}" for b in others)]
    for size, mode, t, ts in lines:
        out.append(f"  {size:>10} {mode:>13} {t:>14.2f}"
                   + "".join(f" {x:>14.2f}" if x else f" {'N/A':>14}" for x in ts)
                   + "".join(f" {t / x:>20.3f}" if x else f" {'N/A':>20}" for x in ts))
    return "\n".join(out)


def markdown_table(rows, collective, base, meta=None):
    """The same comparison as a Markdown table (BENCHMARKS.md): the CPU and ranks it ran on, times in
    us, then the base backend's time over each other's, why a backend refused a case, and the wrong
    elements of the whole collective."""
    meta = meta or {}
    refused = _not_run(meta, collective)
    others, lines = _comparison(rows, collective, base, [x["backend"] for x in refused])
    if not lines:
        return ""
    marks, footnotes = _notes(refused)
    backends = [base] + others
    what = "per round trip (a send and a recv each way)" if collective == "pingpong" else "per call"
    out = [f"{cpu_of(meta)}, {meta.get('world_size', '?')} ranks; us {what}, {timing(meta)}; "
           "KiB, MiB: 1024, 1024^2 bytes.", "",
           "| size | mode | " + " | ".join(backends) + " | " + " | ".join(f"{base}/{b}" for b in others) + " |",
           "| --- " * (2 + len(backends) + len(others)) + "|"]
    for size, mode, t, ts in lines:
        cells = [f"{x:.2f}" if x else "N/A" + (f" [{marks[(b, size, mode)]}]" if (b, size, mode) in marks else "")
                 for b, x in zip(backends, [t] + ts)]
        ratios = [f"{t / x:.3f}" if x else "N/A" for x in ts]
        out.append(f"| {_size(size)} | {mode} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    mine = [r for r in rows if r["collective"] == collective]
    wrong = sum(max(r["wrong"], 0) for r in mine)
    out += [""] + [f"- {note}" for note in footnotes] + ([""] if footnotes else [])
    out += [f"Wrong elements: {wrong}." if any(r["wrong"] >= 0 for r in mine) else "Results not checked (no -c 1)."]
    return "\n".join(out)


JOINT_REFERENCES = ("nop+direct", "direct-group")   # the torch call with an adapter that costs nothing


def _joint_references(rows):
    return [name for name in JOINT_REFERENCES if any(r["backend"] == name for r in rows)]


def torch_layer_table(rows, torch_backend="engine"):
    """What the adapter adds to each call (Markdown), where a run has torch_backend, nop and
    engine-direct: the torch call minus the same call on the do-nothing group (torch's own share)
    minus the direct call. Where the run has nop+direct or direct-group too, also the torch call minus
    each: the same sum timed as one call, so it waits on its peers as the torch call does (and, for
    direct-group, inside torch's call). pingpong makes two calls (a send and a recv) per round trip."""
    index = {(r["backend"], r["collective"], r["size"], r["mode"]): r["time_us"] for r in rows}
    joints = _joint_references(rows)
    lines = []
    for r in rows:
        if r["backend"] != torch_backend:
            continue
        key = (r["collective"], r["size"], r["mode"])
        nop, direct = index.get(("nop",) + key), index.get(("engine-direct",) + key)
        if nop is None or direct is None:
            continue
        calls = 2 if r["collective"] == "pingpong" else 1
        extra = r["time_us"] - nop - direct
        cells = [r["collective"], _size(r["size"]), r["mode"], f"{nop:.2f}", f"{r['time_us']:.2f}", f"{direct:.2f}",
                 f"{extra / calls:.2f}"]
        for name in joints:
            joint = index.get((name,) + key)
            cells += ["", ""] if joint is None else [f"{joint:.2f}", f"{(r['time_us'] - joint) / calls:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = ["collective", "size", "mode", "nop", torch_backend, "engine-direct",
            f"({torch_backend} - nop - direct) per call"]
    for name in joints:
        head += [name, f"({torch_backend} - ({name})) per call"]
    return "\n".join(["| " + " | ".join(head) + " |", "| --- " * len(head) + "|"] + lines)


def _size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def print_report(rows, meta, out):
    print(f"# engine bench: {meta['command']}", file=out)
    print(f"# {meta['world_size']} ranks on {meta['host']} ({meta['cores']} cores), {cpu_of(meta)}", file=out)
    print(f"# torch {meta['torch']}, mpi4py {meta['mpi4py']}, {meta['mpi_library']}", file=out)
    if meta.get("kernel_isa"):
        extra = f", deepspeed {meta['deepspeed']}" if meta.get("deepspeed") else ""
        print(f"# engine kernels: {meta['kernel_isa']}{extra}", file=out)
    print(f"# times: {timing(meta)} (pingpong: per round trip; its unpaired rank's idling not counted); median "
          f"of {meta['rounds']} interleaved rounds, their order rotating", file=out)
    print("# sizes in bytes (KiB, MiB: 1024, 1024^2); algbw, busbw in GB/s, 1 GB = 1e9 bytes", file=out)
    for coll in COLLECTIVES:
        for backend in dict.fromkeys(meta["backends"] + [r["backend"] for r in rows]):  # (one refused throughout too)
            table = backend_table(rows, backend, coll, meta)
            if table:
                print(table + "\n", file=out)
        ratios = ratio_table(rows, coll, meta["backends"][0])
        if ratios:
            print(ratios + "\n", file=out)
    torch_backend = "engine-group" if any(r["backend"] == "engine-group" for r in rows) else "engine"
    layer = torch_layer_table(rows, torch_backend)
    if layer:
        joint = "".join(f", and {torch_backend} - ({name})" for name in _joint_references(rows))
        print(f"# the torch layer's cost (us): {torch_backend} - nop - engine-direct{joint}\n" + layer + "\n", file=out)


def write_json(path, rows, meta):
    with open(path, "w") as f:
        json.dump({"schema": SCHEMA_VERSION, "meta": meta, "rows": rows}, f, indent=1)


def read_json(path):
    with open(path) as f:
        doc = json.load(f)
    validate(doc, path)
    return doc


def validate(doc, where="document"):
    if doc.get("schema") != SCHEMA_VERSION or "meta" not in doc or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{where}: not an engine bench JSON file (schema {SCHEMA_VERSION})")
    for i, row in enumerate(doc["rows"]):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"{where}: row {i} lacks {', '.join(missing)}")
