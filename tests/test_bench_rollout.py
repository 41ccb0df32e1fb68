"""`dynaspec bench rollout` runs end to end on a tiny model: every configuration drains the same
batch, the report holds the tail times and the per-step series, and the plot is written."""

import json

from dynaspec.cli import main
from dynaspec.kpolicy.profile import Profile, derive_table, save_profile


def test_rollout_tiny(tmp_path, target_dir):
    stats = {1: {0: 1.0, 1: 1.1, 2: 1.2}, 8: {0: 1.2, 1: 2.0, 2: 3.0}}
    alpha = [0.9, 0.8]
    profile = tmp_path / "profile.json"
    save_profile(Profile(2, alpha, stats, derive_table(alpha, stats, 2)), profile)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nclass A:\nimport os\nfor i in range(3):\n")
    result, plot = tmp_path / "rollout.json", tmp_path / "rollout.png"
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 2}
    rc = main(
        [
            "bench", "rollout", "--model", str(target_dir), "--dtype", "float32",
            "--kv-cache-memory-gb", "0.02", "--speculative-config", json.dumps(spec),
            "--profile", str(profile), "--dataset", str(prompts), "--num-prompts", "6",
            "--lengths", "longtail", "--median-tokens", "6", "--max-tokens", "24",
            "--fixed-ks", "1,2", "--rounds", "2", "--result-file", str(result), "--plot", str(plot),
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(result.read_text())
    lengths = report["lengths"]
    assert len(lengths) == 6 and max(lengths) > min(lengths)  # a long tail, drawn with a seed
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"none", "K=1", "K=2", "table", "goodput", "per-request"}
    for r in rows.values():
        assert r["output_tokens"] == 2 * sum(lengths)  # ignore EOS: every request runs to its length
        assert 0 < r["t50_s"] <= r["t90_s"] <= r["makespan_s"]
        assert len(r["rounds"]) == 2 and len(r["rounds"][0]["finish_s"]) == 6
        series = r["rounds"][0]["series"]
        assert series[0][1] == 6 and series[-1][1] >= 1  # the batch drains
        generated = [s[3] for s in series]  # cumulative output tokens, all of the round's at the end
        assert generated == sorted(generated) and generated[-1] == sum(lengths)
    ks = [s[2] for s in rows["K=2"]["rounds"][0]["series"]]
    assert ks[-1] == 2 and set(ks) <= {0, 2}  # 0 only in prefill-only steps, before any decode
    assert {s[2] for s in rows["none"]["rounds"][0]["series"]} == {0}
    assert plot.stat().st_size > 0
