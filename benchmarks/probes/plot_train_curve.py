"""Held-out acceptance per draft position against training tokens, from a `dynaspec train-draft`
run's training_log.json (no model runs).

    .venv/bin/python benchmarks/probes/plot_train_curve.py \
        results/zen3/train_draft_qwen15_log.json docs/train_draft_curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(log_path: str, out: str) -> None:
    card = json.loads(Path(log_path).read_text())
    curve = card["curve"]
    tokens = [point["tokens"] for point in curve]
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    for j in range(len(curve[0]["alpha"])):
        ax.plot(tokens, [point["alpha"][j] for point in curve], "o-", markersize=3, label=f"draft {j + 1}")
    ax.set_xlabel("training positions seen (answer tokens x training-time-test steps, with repeats)")
    ax.set_ylabel("held-out acceptance (chain)")
    ax.set_title(
        f"EAGLE-3 head for {card['target']}: {card['train_conversations']} conversations, "
        f"{card['answer_tokens']} answer tokens, {card['seconds']:.0f} s",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot written to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="a training_log.json")
    parser.add_argument("out", help="PNG to write")
    args = parser.parse_args()
    main(args.log, args.out)
