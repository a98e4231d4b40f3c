"""Draws ENGINE_TRACE files (one per rank) as a timeline picture: one row per rank and group, one bar
per operation. The same files open in https://ui.perfetto.dev (or chrome://tracing).

    python scripts/plot_trace.py trace.rank*.json -o timeline.png [--last-ms 50]
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--last-ms", type=float, default=None, help="show only the last N milliseconds")
    args = ap.parse_args()
    events = []
    for path in args.files:
        with open(path) as f:
            events += [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    end = max(e["ts"] + e["dur"] for e in events)
    if args.last_ms:
        events = [e for e in events if e["ts"] + e["dur"] >= end - args.last_ms * 1e3]
    rows = sorted({(e["pid"], e["tid"]) for e in events})
    ops = sorted({e["name"] for e in events})
    colors = {op: f"C{i % 10}" for i, op in enumerate(ops)}
    fig, ax = plt.subplots(figsize=(13, 2.4 + 0.6 * len(rows)))
    for y, (pid, tid) in enumerate(rows):
        for e in (e for e in events if (e["pid"], e["tid"]) == (pid, tid)):
            ax.barh(y, max(e["dur"], 1) / 1e3, left=e["ts"] / 1e3, color=colors[e["name"]],
                    edgecolor="black" if e["args"].get("state") != "done" else "none", height=0.6)
    ax.set_yticks(range(len(rows)), [f"rank {p}, group {t}" for p, t in rows])
    ax.set_xlabel("time (ms)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[o]) for o in ops], labels=ops, ncol=min(6, len(ops)),
              loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize=8, frameon=False)
    ax.set_title("engine operations per rank (ENGINE_TRACE)")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(args.output)


if __name__ == "__main__":
    main()
