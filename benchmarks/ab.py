"""Side by side: one benchmark script against a baseline commit and the working tree.

    cd benchmarks && ../.venv/bin/python ab.py --baseline main --rounds 5 \\
        -- bench_worker.py --rounds 1 --no-async

Each round runs the script twice, once with ``git archive <baseline> sqla_outbox`` first
on ``PYTHONPATH`` ("baseline") and once on the working tree ("this tree"), in alternating
order (the side that goes first changes every round), each run with ``--json`` into a
temporary file. The script is the working tree's in both runs; only the library differs.
On this shared machine a load burst from other work tends to hit both runs of a round, so
the per-round ratio (this tree / baseline) is the figure to read, with the medians.

Printed and written (``--json``): for every "Judged by" figure the script reports (its
ratios, e.g. dispatch / hand-written floor, or the worker's CPU per run), the median per
side, the min and max, and the median of the per-round ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_side(script: list[str], pythonpath: str | None, out: Path) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    subprocess.run(
        [sys.executable, *script, "--json", str(out)], check=True, env=env, cwd=ROOT / "benchmarks"
    )
    document = json.loads(out.read_text())
    figures = {r["name"]: float(r["value"]) for r in document.get("ratios", [])}
    figures["library"] = 0.0  # placeholder so every side has at least one key
    source = document.get("machine", {}).get("library", {}) or document.get("library", {})
    print(f"    library: {json.dumps(source)[:160]}", flush=True)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="main", help="git ref of the baseline library (default main)")
    p.add_argument("--rounds", type=int, default=5, help="A/B rounds (default 5)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [its arguments]")
    args = p.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        p.error("name the script after --")
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = Path(tmp) / "baseline"
        snapshot.mkdir()
        archive = subprocess.run(
            ["git", "archive", args.baseline, "sqla_outbox"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(snapshot)], input=archive, check=True)
        commit = subprocess.run(
            ["git", "rev-parse", "--short", args.baseline],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.strip()
        sides = {
            f"baseline {args.baseline} ({commit})": str(snapshot),
            f"this tree (HEAD {head} + changes)": None,
        }
        names = list(sides)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
                runs[name].append(run_side(script, sides[name], Path(tmp) / f"{r}-{names.index(name)}.json"))
    base, new = names
    keys = [k for k in runs[base][0] if k != "library" and all(k in x for x in runs[base] + runs[new])]
    table = []
    for key in keys:
        a = [x[key] for x in runs[base]]
        b = [x[key] for x in runs[new]]
        table.append(
            {
                "figure": key,
                "baseline_median": statistics.median(a),
                "baseline_min": min(a),
                "baseline_max": max(a),
                "new_median": statistics.median(b),
                "new_min": min(b),
                "new_max": max(b),
                "new_over_baseline": statistics.median([y / x for x, y in zip(a, b, strict=True) if x]),
            }
        )
    print()
    print(f"{' '.join(script)}: {args.rounds} A/B rounds; baseline = {names[0]}; new = {names[1]}")
    for row in table:
        print(
            f"  {row['figure']}: baseline {row['baseline_median']:.3f} "
            f"({row['baseline_min']:.3f}..{row['baseline_max']:.3f})"
            f"  new {row['new_median']:.3f} ({row['new_min']:.3f}..{row['new_max']:.3f})"
            f"  new/baseline {row['new_over_baseline']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "sides": names,
                    "rounds": args.rounds,
                    "figures": table,
                    "runs": runs,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
