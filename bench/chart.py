"""Draw a saved run as a PNG: tokens/s of every system, one group of bars per profile.

    python bench/chart.py                                   # bench/.results/last.json -> bench/tokens_per_s.png
    python bench/chart.py --report RUN.json --out chart.png

Needs matplotlib (``pip install matplotlib``; not a poolrunner dependency).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=BENCH / ".results" / "last.json", help="a run's JSON")
    parser.add_argument("--out", type=Path, default=BENCH / "tokens_per_s.png", help="the PNG to write")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    draw(report, args.out)
    print(f"wrote {args.out}")


def draw(report: dict, out: Path) -> None:
    """Horizontal bars per profile (one panel each), poolrunner's bars highlighted."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    profiles = {name: p for name, p in report["profiles"].items() if p.get("rows")}
    height = sum(0.8 + 0.26 * len(profile["rows"]) for profile in profiles.values())
    fig, axes = plt.subplots(len(profiles), 1, figsize=(9, height), squeeze=False)
    for ax, (name, profile) in zip(axes[:, 0], profiles.items(), strict=True):
        rows = [row for row in profile["rows"] if "tokens_per_s" in row]
        labels = [row["system"] for row in rows]
        values = [row["tokens_per_s"] for row in rows]
        colors = ["tab:orange" if row["family"] == "poolrunner" else "tab:gray" if row["family"].startswith(
            "poolrunner") else "tab:blue" for row in rows]
        ax.barh(labels, values, color=colors)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {profile['texts']} texts, {profile['tokens'] / profile['texts']:.1f} tokens each",
                     fontsize=10, loc="left")
        ax.set_xlabel("tokens/s")
        for y, value in enumerate(values):
            ax.text(value, y, f" {value:,.0f}", va="center", fontsize=7)
        ax.tick_params(axis="y", labelsize=8)
    machine = report["machine"]
    fig.suptitle(f"{machine.get('cpu', 'CPU')}, {machine.get('cores', '?')} cores, torch {machine.get('torch', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
