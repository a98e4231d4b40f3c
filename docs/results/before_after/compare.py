"""Before/after table from the interleaved runs: medians over every round of every run of a tree."""
import glob, json, statistics, sys
from collections import defaultdict
import os
OUT = os.environ.get("OUT") or os.path.dirname(os.path.abspath(__file__))
trees = sys.argv[1:] or ["before20", "new"]
for kind in ("all", "ar"):
    s = defaultdict(list)       # (tree, coll, mode, size, backend) -> samples
    run_med = defaultdict(list)  # per-run medians, for the spread within a tree
    for tree in trees:
        for f in sorted(glob.glob(f"{OUT}/{kind}_{tree}_*.json")):
            for r in json.load(open(f))["rows"]:
                k = (tree, r["collective"], r["mode"], r["size"], r["backend"])
                s[k] += r["samples_us"]
                run_med[k].append(r["time_us"])
    keys = sorted({k[1:4] for k in s})
    print(f"\n### {kind}: {' vs '.join(trees)} (us, medians of every round; ratio = {trees[-1]}/{trees[0]})\n")
    print("| collective | mode | size | " + " | ".join(f"direct {t}" for t in trees) + " | direct ratio | "
          + " | ".join(f"dist {t}" for t in trees) + " | dist ratio | mpi4py ratio (noise) |")
    print("|---|---|---|" + "---|" * (2 * len(trees) + 3))
    worst = []
    for coll, mode, size in keys:
        def med(t, b):
            v = s.get((t, coll, mode, size, b))
            return statistics.median(v) if v else None
        d = [med(t, "engine-direct") for t in trees]
        e = [med(t, "engine") for t in trees]
        m = [med(t, "mpi4py") for t in trees]
        if None in d:
            continue
        rd = d[-1] / d[0]
        re_ = e[-1] / e[0] if None not in e else None
        rm = m[-1] / m[0] if None not in m else None
        worst.append((rd, coll, mode, size))
        cells = [coll, mode, str(size)] + [f"{x:.2f}" for x in d] + [f"{rd:.3f}"]
        cells += [f"{x:.2f}" if x else "-" for x in e] + [f"{re_:.3f}" if re_ else "-", f"{rm:.3f}" if rm else "-"]
        print("| " + " | ".join(cells) + " |")
    worst.sort(reverse=True)
    print("\nslowest direct ratios:", ", ".join(f"{c} {m} {sz}: {r:.3f}" for r, c, m, sz in worst[:6]))
