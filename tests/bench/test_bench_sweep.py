"""`dynaspec bench sweep` runs end to end on a tiny model and writes its JSON and plot."""

import json

from support.eagle import target_config, write_head

from dynaspec.cli import main
from dynaspec.kpolicy.profile import Profile, derive_table, save_profile


def test_sweep_tiny(tmp_path, target_dir):
    stats = {1: {0: 1.0, 1: 1.1, 2: 1.2}, 4: {0: 1.2, 1: 2.0, 2: 3.0}}
    alpha = [0.9, 0.8]
    profile = tmp_path / "profile.json"
    save_profile(Profile(2, alpha, stats, derive_table(alpha, stats, 2)), profile)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nclass A:\nimport os\nfor i in range(3):\n")
    result, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 2}
    rc = main(
        [
            "bench",
            "sweep",
            "--model",
            str(target_dir),
            "--dtype",
            "float32",
            "--kv-cache-memory-gb",
            "0.02",
            "--speculative-config",
            json.dumps(spec),
            "--profile",
            str(profile),
            "--dataset",
            str(prompts),
            "--concurrency",
            "1,2",
            "--prompts-per-concurrency",
            "2",
            "--min-prompts",
            "3",
            "--fixed-ks",
            "1,2",
            "--max-tokens",
            "6",
            "--rounds",
            "2",
            "--result-file",
            str(result),
            "--plot",
            str(plot),
        ]
    )
    assert rc == 0
    report = json.loads(result.read_text())
    configs = {r["config"] for r in report["rows"]}
    assert configs == {"none", "K=1", "K=2", "table", "goodput", "per-request"}
    assert all(r["output_tokens_per_s"] > 0 for r in report["rows"])
    # greedy: every configuration emits exactly what the target alone does
    # C=1 runs --min-prompts (3) prompts, C=2 runs 2 x 2
    assert all(
        r["requests_identical_to_none"] == ("3/3" if r["concurrency"] == 1 else "4/4") for r in report["rows"]
    )
    # two rounds each (ABBA order), pooled: every configuration ran all its prompts
    assert all(len(r["tokens_per_s_by_round"]) == 2 for r in report["rows"])
    assert set(report["totals"]) == configs
    assert plot.stat().st_size > 10_000
    # rounds are paired with the pooled best other configuration's rounds
    goodput = [r for r in report["rows"] if r["config"] == "goodput"]
    assert all(len(r["vs_best_other_by_round"]) == 2 and r["best_other"] != "goodput" for r in goodput)


def test_saved_sweep_is_recompared_and_replotted(tmp_path, capsys):
    rows = [
        {
            "concurrency": c,
            "config": name,
            "output_tokens_per_s": rate,
            "wall_s": 10.0 / rate,
            "tpot_mean_ms": 100.0,
            "tpot_median_ms": 90.0,
            "acceptance_length": None,
            "tokens_per_s_by_round": [rate * 0.9, rate * 1.1],
        }
        for c, rates in (
            (1, {"none": 2.0, "K=1": 4.0, "goodput": 3.9}),
            (2, {"none": 5.0, "K=1": 4.0, "goodput": 5.1}),
        )
        for name, rate in rates.items()
    ] + [
        {"concurrency": 4, "config": "none", "output_tokens_per_s": 6.0, "wall_s": 1.0}
    ]  # a cut run: C=4 incomplete
    saved, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    saved.write_text(json.dumps({"rows": rows}))
    assert main(["bench", "sweep", "--from-json", str(saved), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "0.975" in out and "1.020" in out  # 3.9 / 4.0 at C=1, 5.1 / 5.0 at C=2
    assert "   4 " not in out and plot.stat().st_size > 10_000
    saved.write_text("[1, 2]")
    assert main(["bench", "sweep", "--from-json", str(saved)]) == 2


def k1_profile_and_prompts(tmp_path, text: str):
    """A K <= 1 profile over batch sizes 1 and 2, and a prompt file of ``text``."""
    stats = {1: {0: 1.0, 1: 1.1}, 2: {0: 1.1, 1: 1.5}}
    profile = tmp_path / "profile.json"
    save_profile(Profile(1, [0.9], stats, derive_table([0.9], stats, 1)), profile)
    prompts = tmp_path / "p.txt"
    prompts.write_text(text)
    return profile, prompts


def test_sweep_runs_a_chosen_subset_and_refuses_unknown_configs(tmp_path, target_dir, capsys):
    profile, prompts = k1_profile_and_prompts(tmp_path, "def f(x):\nclass A:\n")
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 1}
    common = [
        "bench",
        "sweep",
        "--model",
        str(target_dir),
        "--dtype",
        "float32",
        "--kv-cache-memory-gb",
        "0.02",
        "--speculative-config",
        json.dumps(spec),
        "--profile",
        str(profile),
        "--dataset",
        str(prompts),
        "--concurrency",
        "2",
        "--min-prompts",
        "2",
        "--prompts-per-concurrency",
        "1",
        "--fixed-ks",
        "1",
        "--max-tokens",
        "4",
        "--rounds",
        "1",
    ]
    result = tmp_path / "sweep.json"
    assert main(common + ["--configs", "K=1,goodput", "--result-file", str(result)]) == 0
    rows = json.loads(result.read_text())["rows"]
    assert {r["config"] for r in rows} == {"K=1", "goodput"} and all(
        r["output_tokens_per_s"] > 0 for r in rows
    )
    # the opt-in A/B: per-request beside itself without confidence stops
    assert main(common + ["--configs", "per-request,stops-off", "--result-file", str(result)]) == 0
    policies = {r["config"]: r["policy"] for r in json.loads(result.read_text())["rows"]}
    assert set(policies) == {"per-request", "stops-off"}
    assert policies["stops-off"]["min_draft_confidence"] == 0
    for bad, named in (("none,K=7", "K=7"), ("goodput", "at least two")):
        assert main(common + ["--configs", bad, "--result-file", str(result)]) == 2
        assert "--configs: " + named in capsys.readouterr().err


def test_sweep_with_auto_takes_the_engines_own_profile(tmp_path, target_dir, monkeypatch, capsys):
    """`--profile auto` (or a config saying "dynamic_config_path": "auto") prices the policies with the
    profile an engine with that config makes on first use (here a stand-in for the minutes-long real
    one) and records where it is cached; a file beside a config saying "auto" is refused."""
    import dynaspec.engine.profiler as profiler
    from dynaspec.kpolicy.profile import load_profile

    stats = {1: {0: 1.0, 1: 1.1}, 2: {0: 1.1, 1: 1.5}}
    profile = tmp_path / "profile.json"
    save_profile(Profile(1, [0.9], stats, [[1, 1, 1], [2, 2, 0]]), profile)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nclass A:\n")
    asked = []

    def stand_in(engine, spec):
        asked.append((spec.method, spec.num_speculative_tokens))
        return load_profile(profile)

    monkeypatch.setattr(profiler, "auto_profile", stand_in)
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1}
    common = [
        "bench", "sweep", "--model", str(target_dir), "--dtype", "float32", "--kv-cache-memory-gb", "0.02",
        "--dataset", str(prompts), "--concurrency", "1", "--min-prompts", "2",
        "--prompts-per-concurrency", "1", "--fixed-ks", "1", "--configs", "none,table",
        "--max-tokens", "4", "--rounds", "1",
    ]  # fmt: skip
    for i, how in enumerate(
        (["--profile", "auto"], ["--speculative-config", json.dumps({**spec, "dynamic_config_path": "auto"})])
    ):
        result = tmp_path / f"sweep{i}.json"
        args = ["--speculative-config", json.dumps(spec), *how, "--result-file", str(result)]
        assert main(common + args) == 0
        report = json.loads(result.read_text())
        assert report["profile_table"] == [[1, 1, 1], [2, 2, 0]]
        assert report["profile"].endswith(".json") and "profiles" in report["profile"]
        assert {r["config"] for r in report["rows"]} == {"none", "table"}
    assert asked == [("ngram", 1), ("ngram", 1)]
    auto = json.dumps({**spec, "dynamic_config_path": "auto"})
    assert main(common + ["--speculative-config", auto, "--profile", str(profile)]) == 2
    assert (
        '--profile: the speculative config already says "dynamic_config_path": "auto"'
        in capsys.readouterr().err
    )


def test_warm_prompts_time_runs_on_cached_prompts_and_need_prefix_caching(tmp_path, target_dir, capsys):
    text = "def fibonacci(n): return the n-th number of the sequence, fast\nclass A:\n"
    profile, prompts = k1_profile_and_prompts(tmp_path, text)
    result = tmp_path / "sweep.json"

    def sweep(spec: dict) -> int:
        args = ["bench", "sweep", "--model", str(target_dir), "--dtype", "float32"]
        args += ["--kv-cache-memory-gb", "0.02", "--speculative-config", json.dumps(spec)]
        args += ["--profile", str(profile), "--dataset", str(prompts), "--concurrency", "1,2"]
        args += ["--min-prompts", "2", "--prompts-per-concurrency", "1", "--fixed-ks", "1"]
        args += ["--configs", "none,K=1", "--max-tokens", "4", "--rounds", "1", "--warm-prompts"]
        return main(args + ["--result-file", str(result)])

    assert sweep({"method": "ngram", "num_speculative_tokens": 1}) == 0
    report = json.loads(result.read_text())
    assert report["warm_prompts"] and {r["concurrency"] for r in report["rows"]} == {1, 2}
    for stats_ in report["prefix_cache"].values():  # every run found its prompts cached
        assert stats_["enabled"] and stats_["hit_rate"] > 0.5
    draft = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 1}
    assert sweep(draft) == 0
    assert all(s["hit_rate"] > 0.5 for s in json.loads(result.read_text())["prefix_cache"].values())
    head = write_head(tmp_path / "head", "eagle3", target_config(target_dir))
    assert sweep({"method": "eagle3", "model": str(head), "num_speculative_tokens": 1}) == 2
    assert "enable_prefix_caching: not with speculative_config.method 'eagle3'" in capsys.readouterr().err


def test_warm_policies_carry_one_policy_per_config_from_run_to_run(tmp_path, target_dir):
    """By default every run starts a fresh K policy; with --warm-policies each configuration keeps
    one, as a server keeps its own: the last run's policy has seen every earlier run's steps."""
    profile, prompts = k1_profile_and_prompts(tmp_path, "def f(x):\nclass A:\n")
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 1}
    common = ["bench", "sweep", "--model", str(target_dir), "--dtype", "float32"]
    common += ["--kv-cache-memory-gb", "0.02", "--speculative-config", json.dumps(spec)]
    common += ["--profile", str(profile), "--dataset", str(prompts), "--concurrency", "1,2"]
    common += ["--min-prompts", "2", "--prompts-per-concurrency", "1", "--fixed-ks", "1"]
    common += ["--max-tokens", "6", "--rounds", "2", "--configs", "K=1,per-request"]
    seen = {}
    for warm in (False, True):
        result = tmp_path / f"sweep_{warm}.json"
        assert main(common + ["--result-file", str(result)] + (["--warm-policies"] if warm else [])) == 0
        report = json.loads(result.read_text())
        assert report["warm_policies"] is warm
        row = next(r for r in report["rows"] if r["config"] == "per-request" and r["concurrency"] == 2)
        seen[warm] = row["policy"]["cost_model"]["observations"]["target"]
    # a fresh policy saw one run (one prompt of 6 tokens); the kept one all four runs
    assert seen[False] <= 7 and seen[True] >= 3 * seen[False]
