"""python -m bench plot FILE... -o OUT.png: bus bandwidth and latency against size, log axes, one line
per (file, backend, collective, mode)."""

import os

from .report import cpu_of, read_json


def title(meta, cpus):
    """The figure's title from the last file's meta; the CPU where every file's is the same one."""
    cpu = f", {next(iter(cpus))}" if len(cpus) == 1 else ""
    return f"{meta['world_size']} ranks" + (" (oversubscribed)" if meta.get("oversubscribed") else "") + \
        f", {meta['dtype']}, {meta['host']} ({meta['cores']} cores{cpu})"


def plot(paths, out, collective=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    multi = len(paths) > 1
    colors = {}  # one colour per (file, backend, collective); the line style tells the mode
    docs = {path: read_json(path) for path in paths}
    cpus = {cpu_of(doc["meta"]) for doc in docs.values()}
    for path, doc in docs.items():
        meta = doc["meta"]
        # the CPU beside every line where the files' differ, else once in the title
        tag = (f"{os.path.basename(path)}" + (f" ({cpu_of(meta)})" if len(cpus) > 1 else "") + ": ") if multi else ""
        lines = {}
        for row in doc["rows"]:
            if collective and row["collective"] != collective or row["collective"] == "barrier":
                continue
            key = (row["backend"], row["collective"], row["mode"])
            lines.setdefault(key, []).append(row)
        for (backend, coll, mode), rows in sorted(lines.items()):
            rows.sort(key=lambda r: r["size"])
            label = f"{tag}{backend} {coll}" + (" (in-place)" if mode == "in-place" else "")
            sizes = [r["size"] for r in rows]
            style = "--" if mode == "in-place" else "-"
            color = colors.setdefault((path, backend, coll), f"C{len(colors) % 10}")
            ax_bw.plot(sizes, [max(r["busbw"], 1e-6) for r in rows], style, color=color, marker="o", ms=3, label=label)
            ax_t.plot(sizes, [r["time_us"] for r in rows], style, color=color, marker="o", ms=3, label=label)
    for ax, ylabel in ((ax_bw, "bus bandwidth (GB/s, 1 GB = 1e9 bytes)"),
                       (ax_t, "time per call (us; pingpong: per round trip)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_title("bus bandwidth (higher is better)")
    ax_t.set_title("latency (lower is better)")
    ax_t.legend(fontsize=8)
    fig.suptitle(title(meta, cpus))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out
