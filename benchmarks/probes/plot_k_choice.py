"""The goodput policy's K against load and acceptance, from a profile (no model runs).

    .venv/bin/python benchmarks/probes/plot_k_choice.py \
        results/profile_qwen_pair_humaneval.json docs/k_choice.png

For each load (requests in the step) and each per-token acceptance β of a request (its α_i set to
the profile's shape scaled as ``request_rates`` scales it), the K the per-request policy gives that
request when every other request of the load accepts as the profile measured (left), and the K of
the batch-level rule when the whole batch accepts at β (right).
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from dynaspec.engine.types import DraftCandidate
from dynaspec.kpolicy.acceptance import per_token_acceptance, request_rates
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile

LOADS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
BETAS = [round(b, 2) for b in np.linspace(0.3, 0.98, 18)]


def main(profile_path: str, out: str) -> None:
    profile = load_profile(profile_path)
    max_k = profile.max_num_speculative_tokens
    base = per_token_acceptance(profile.acceptance_rate_per_pos)
    per_request = np.zeros((len(BETAS), len(LOADS)), dtype=int)
    batch = np.zeros_like(per_request)
    for i, beta in enumerate(BETAS):
        for j, load in enumerate(LOADS):
            policy = GoodputK(profile, max_k, hysteresis_steps=1, per_request=True)
            # the request under study has a long record at beta: accepted/trials = beta, 200 trials
            policy.requests.counts["probe"] = (200.0 * beta, 200.0)
            others = [DraftCandidate(1, 1000, request_id=f"r{n}") for n in range(load - 1)]
            per_request[i, j] = policy.choose([DraftCandidate(1, 1000, request_id="probe"), *others])[1][0]
            flat = GoodputK(profile, max_k, hysteresis_steps=1, per_request=False)
            flat.acceptance.prior = request_rates(200.0 * beta, 200.0, profile.acceptance_rate_per_pos)
            batch[i, j] = flat.choose([DraftCandidate(1, 1000)] * load)[0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, grid, title in (
        (axes[0], per_request, "per-request K of one request\n(the others accept as profiled)"),
        (axes[1], batch, "batch-level K\n(every request accepts at β)"),
    ):
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=max_k)
        for (r, c), k in np.ndenumerate(grid):
            ax.text(c, r, str(k), ha="center", va="center", fontsize=7, color="white" if k < 3 else "black")
        ax.set_xticks(range(len(LOADS)), LOADS)
        ax.set_yticks(range(len(BETAS))[::2], BETAS[::2])
        ax.set_xlabel("load (requests in the step)")
        ax.set_title(title)
    axes[0].set_ylabel("per-token acceptance β of the request")
    fig.colorbar(im, ax=axes, label="K")
    model = profile.meta.get("model", profile_path)
    fig.suptitle(f"goodput policy's K on {model} (profile: β={base:.2f})", y=1.04)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"plot written to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="profile JSON (e.g. results/profile_qwen_pair_humaneval.json)")
    parser.add_argument("out", help="PNG to write (docs/k_choice.png is the one the docs show)")
    args = parser.parse_args()
    main(args.profile, args.out)
