"""The goodput policy's K against load and context length, from a profile with a context axis
(no model runs).

    .venv/bin/python benchmarks/probes/plot_k_context.py \
        results/zen3/profile_pair_context.json docs/k_context.png

For each load (requests in the step, each caught up) and each mean context per request, the
batch-level K of the goodput policy with the profile's context axis (left) and without it, as
every profile was priced before (right): the same K at every context.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from dynaspec.bench.common import without_context_axis
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile

LOADS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
CONTEXTS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def main(profile_path: str, out: str) -> None:
    profile = load_profile(profile_path)
    if profile.context_cost is None:
        raise SystemExit(f"{profile_path}: no context axis (profile it with --context-lengths)")
    blind = without_context_axis(profile)
    max_k = profile.max_num_speculative_tokens
    grids = []
    for source in (profile, blind):
        grid = np.zeros((len(CONTEXTS), len(LOADS)), dtype=int)
        for i, context in enumerate(CONTEXTS):
            for j, load in enumerate(LOADS):
                policy = GoodputK(source, max_k, hysteresis_steps=1, per_request=False)
                grid[i, j] = policy.k_for_batch(load, context)
        grids.append(grid)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True)
    u, v = profile.context_cost
    titles = (
        f"with the context axis\n(+{u:.2f} ms a request, +{v:.2f} ms a draft token,\n"
        "per 1,000 context tokens)",
        f"context-blind\n(the grid's {profile.context_tokens:.0f}-token contexts everywhere)",
    )
    for ax, grid, title in zip(axes, grids, titles):
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=max_k)
        for (r, c), k in np.ndenumerate(grid):
            ax.text(c, r, str(k), ha="center", va="center", fontsize=8, color="white" if k < 3 else "black")
        ax.set_xticks(range(len(LOADS)), LOADS)
        ax.set_yticks(range(len(CONTEXTS)), CONTEXTS)
        ax.set_xlabel("load (requests in the step)")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("mean context per request (tokens)")
    fig.colorbar(im, ax=axes, label="K")
    model = profile.meta.get("model") or profile.meta.get("auto_key", {}).get("target", profile_path)
    fig.suptitle(f"goodput policy's K against load and context on {model}", y=1.03)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"plot written to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile JSON with context_stats")
    parser.add_argument("out", help="PNG to write (docs/k_context.png is the one the docs show)")
    args = parser.parse_args()
    main(args.profile, args.out)
