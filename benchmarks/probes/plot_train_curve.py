"""Held-out acceptance per draft position against training tokens, from a `dynaspec train-draft`
run's training_log.json (no model runs). A run resumed on more data measures its head again on
a new held-out set (two points at one step): each held-out set is drawn as its own segment, with
``--segments`` naming them (e.g. the conversations trained on), since their figures do not compare.

    .venv/bin/python benchmarks/probes/plot_train_curve.py \
        results/xeon/eagle41d/train_draft_log_2107.json.gz docs/train_draft_curve.png \
        --segments "928 conv.,1262 conv.,2002 conv."
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def segments(curve: list[dict]) -> list[list[dict]]:
    """The curve cut where a resumed run measured again at the same step (a new held-out set)."""
    out: list[list[dict]] = [[]]
    for point in curve:
        if out[-1] and point["step"] == out[-1][-1]["step"]:
            out.append([])
        out[-1].append(point)
    return out


def main(log_path: str, out: str, names: list[str]) -> None:
    data = Path(log_path).read_bytes()
    card = json.loads(gzip.decompress(data) if log_path.endswith(".gz") else data)
    parts = segments(card["curve"])
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for s, part in enumerate(parts):
        tokens = [point["tokens"] for point in part]
        if s:
            name = names[s] if s < len(names) else f"held-out set {s + 1}"
            ax.axvline(tokens[0], color="grey", linestyle=":", linewidth=1)
            ax.annotate(
                f" resumed, {name}:\n new held-out set",
                (tokens[0], 0.55),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                ha="left",
                va="center",
                color="grey",
            )
        for j in range(len(part[0]["alpha"])):
            label = f"draft {j + 1}" if s == 0 else None
            ax.plot(
                tokens,
                [point["alpha"][j] for point in part],
                "o-",
                markersize=3,
                color=colors[j],
                label=label,
            )
    if len(parts) > 1:
        first = names[0] if names else "held-out set 1"
        ax.annotate(
            f"held-out set of {first}", (0.01, 0.02), xycoords="axes fraction", fontsize=7, color="grey"
        )
    ax.set_xlabel("training positions seen (answer tokens x training-time-test steps, with repeats)")
    ax.set_ylabel("held-out acceptance (chain)")
    ax.set_title(
        f"EAGLE-3 head for {card['target']}: {card['train_conversations']} conversations, "
        f"{card['answer_tokens']} answer tokens, {card['seconds']:.0f} s",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.set_ylim(top=max(p["alpha"][0] for p in card["curve"]) * 1.25)  # room for the legend
    ax.legend(loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot written to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="a training_log.json")
    parser.add_argument("out", help="PNG to write")
    parser.add_argument("--segments", default="", help="comma-separated names of the held-out sets, in order")
    args = parser.parse_args()
    main(args.log, args.out, [n.strip() for n in args.segments.split(",") if n.strip()])
