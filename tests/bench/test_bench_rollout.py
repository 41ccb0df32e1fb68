"""`dynaspec bench rollout` runs end to end on a tiny model: every configuration drains the same
batch, the report holds the tail times and the per-step series, and the plot is written."""

import json

import pytest

from dynaspec.cli import main
from dynaspec.kpolicy.profile import Profile, derive_table, save_profile


def tiny_inputs(tmp_path):
    stats = {1: {0: 1.0, 1: 1.1, 2: 1.2}, 8: {0: 1.2, 1: 2.0, 2: 3.0}}
    alpha = [0.9, 0.8]
    profile = tmp_path / "profile.json"
    save_profile(Profile(2, alpha, stats, derive_table(alpha, stats, 2)), profile)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nclass A:\nimport os\nfor i in range(3):\n")
    return profile, prompts


def test_rollout_tiny(tmp_path, target_dir):
    profile, prompts = tiny_inputs(tmp_path)
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
        assert 0 < r["longest_step_s"] <= r["makespan_s"]
        assert len(r["rounds"]) == 2 and len(r["rounds"][0]["finish_s"]) == 6
        series = r["rounds"][0]["series"]
        assert series[0][1] == 6 and series[-1][1] >= 1  # the batch drains
        generated = [s[3] for s in series]  # cumulative output tokens, all of the round's at the end
        assert generated == sorted(generated) and generated[-1] == sum(lengths)
    ks = [s[2] for s in rows["K=2"]["rounds"][0]["series"]]
    assert ks[-1] == 2 and set(ks) <= {0, 2}  # 0 only in prefill-only steps, before any decode
    assert {s[2] for s in rows["none"]["rounds"][0]["series"]} == {0}
    assert plot.stat().st_size > 0
    model = report["model"]["makespan_s"]  # the profile's prediction, with this run's acceptance
    assert set(model) == {"none", "K=1", "K=2", "best K per batch size"}
    assert model["best K per batch size"] <= min(model[c] for c in ("none", "K=1", "K=2")) + 1e-9


def test_rollout_runs_each_policy_again_with_a_draft_context_window(tmp_path, target_dir):
    profile, prompts = tiny_inputs(tmp_path)
    result = tmp_path / "rollout.json"
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 2}
    rc = main(
        [
            "bench", "rollout", "--model", str(target_dir), "--dtype", "float32",
            "--kv-cache-memory-gb", "0.02", "--speculative-config", json.dumps(spec),
            "--profile", str(profile), "--dataset", str(prompts), "--num-prompts", "4",
            "--lengths", "longtail", "--median-tokens", "6", "--max-tokens", "16", "--fixed-ks", "",
            "--draft-context-window", "2", "--result-file", str(result),
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(result.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    policies = ("table", "goodput", "per-request")
    assert set(rows) == {"none", *policies, *(f"{p} w=2" for p in policies)}
    assert all(r["output_tokens"] == sum(report["lengths"]) for r in rows.values())
    assert report["model"] is None  # no fixed K ran, so no acceptance to model with


def test_ngram_rollout_configs_emit_none_s_text_in_each_round(tmp_path, target_dir):
    """With n-gram drafts every configuration of a round samples the same text as no speculation,
    and the next round's seeds give another text."""
    profile, prompts = tiny_inputs(tmp_path)
    result = tmp_path / "rollout.json"
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    rc = main(
        [
            "bench", "rollout", "--model", str(target_dir), "--dtype", "float32",
            "--kv-cache-memory-gb", "0.02", "--speculative-config", json.dumps(spec),
            "--profile", str(profile), "--dataset", str(prompts), "--num-prompts", "4",
            "--lengths", "longtail", "--median-tokens", "8", "--max-tokens", "24",
            "--fixed-ks", "1,2", "--rounds", "2", "--result-file", str(result),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = {r["config"]: r for r in json.loads(result.read_text())["rows"]}
    none = [rnd["text"] for rnd in rows["none"]["rounds"]]
    assert none[0] != none[1]
    for r in rows.values():
        assert [rnd["text"] for rnd in r["rounds"]] == none
        assert r["same_text_as_none"] == 2


def test_drafters_run_side_by_side_each_with_its_own_profile(tmp_path, target_dir):
    """n-gram (the --profile) and suffix drafts (the profile its dynamic_config_path names) in the
    same rounds: each drafter's fixed K and policy under its method's name, every one emitting
    none's text, on engines of their own (suffix drafts what n-gram cannot: its acceptance differs)."""
    profile, prompts = tiny_inputs(tmp_path)
    result = tmp_path / "rollout.json"
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    suffix = {"method": "suffix", "num_speculative_tokens": 2, "dynamic_config_path": str(profile)}
    rc = main(
        [
            "bench", "rollout", "--model", str(target_dir), "--dtype", "float32",
            "--kv-cache-memory-gb", "0.02", "--speculative-config", json.dumps(ngram),
            "--also-speculative-config", json.dumps(suffix), "--profile", str(profile),
            "--policies", "per-request", "--dataset", str(prompts), "--num-prompts", "3",
            "--samples-per-prompt", "2", "--temperature", "0", "--max-tokens", "16",
            "--fixed-ks", "2", "--rounds", "2", "--result-file", str(result),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = {r["config"]: r for r in json.loads(result.read_text())["rows"]}
    assert list(rows) == ["none", "ngram K=2", "ngram per-request", "suffix K=2", "suffix per-request"]
    for r in rows.values():
        assert r["same_text_as_none"] == 2
    assert (
        rows["ngram K=2"]["rounds"][0]["acceptance_per_pos"]
        != rows["suffix K=2"]["rounds"][0]["acceptance_per_pos"]
    )


def test_config_names_of_several_drafters_and_which_are_fixed():
    from dynaspec.bench.rollout import drafter_names, is_fixed
    from dynaspec.kpolicy.config import SpeculativeConfig

    def spec(method, **kw):
        model = {"model": "x"} if method == "draft_model" else {}
        return SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 3} | model | kw)

    assert drafter_names([spec("suffix")]) == [""]
    three = [spec("suffix"), spec("draft_model"), spec("draft_model")]
    assert drafter_names(three) == ["suffix", "draft_model#1", "draft_model#2"]
    both = [spec("draft_model"), spec("draft_model", enable_suffix_decoding=True)]
    assert drafter_names(both) == ["draft_model", "draft_model+suffix"]
    assert [is_fixed(c) for c in ("none", "K=2", "ngram K=5 w=64", "per-request", "suffix table")] == [
        True,
        True,
        True,
        False,
        False,
    ]


def test_grpo_rollout_samples_each_prompt_and_keeps_the_suffix_cache_between_epochs(tmp_path, target_dir):
    """2 prompts x 3 samples, 2 epochs, suffix drafts: each epoch runs the 6 requests, every config
    emits none's text in each epoch (new seeds in the second), and the second epoch drafts from the
    first's cached outputs: more drafts kept than in the first, where no config saw another's."""
    profile, prompts = tiny_inputs(tmp_path)
    result = tmp_path / "rollout.json"
    spec = {"method": "suffix", "num_speculative_tokens": 2}
    rc = main(
        [
            "bench", "rollout", "--model", str(target_dir), "--dtype", "float32",
            "--kv-cache-memory-gb", "0.02", "--speculative-config", json.dumps(spec),
            "--profile", str(profile), "--policies", "goodput", "--dataset", str(prompts),
            "--num-prompts", "2", "--samples-per-prompt", "3", "--epochs", "2", "--temperature", "0",
            "--max-tokens", "16", "--fixed-ks", "2", "--result-file", str(result),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = {r["config"]: r for r in json.loads(result.read_text())["rows"]}
    assert set(rows) == {f"{c} e{e}" for c in ("none", "K=2", "goodput") for e in (1, 2)}
    for r in rows.values():
        assert len(r["rounds"][0]["finish_s"]) == 6
        epoch = r["config"].split(" ")[-1]
        assert r["rounds"][0]["text"] == rows[f"none {epoch}"]["rounds"][0]["text"]
    # greedy: the second epoch repeats the first's text, which the cache then drafts
    assert rows["K=2 e1"]["rounds"][0]["text"] == rows["K=2 e2"]["rounds"][0]["text"]
    first, second = (rows[f"K=2 e{e}"]["rounds"][0]["acceptance_per_pos"] for e in (1, 2))
    assert second[0] > 0.9 and second[0] > first[0]


def test_modelled_makespans_pick_k_by_batch_size():
    from dynaspec.bench.rollout import modelled_makespans

    # speculation pays alone (K=2 at batch 1) and costs at batch 8: the tail is where K rises
    stats = {1: {0: 10.0, 1: 11.0, 2: 12.0}, 8: {0: 12.0, 1: 30.0, 2: 48.0}}
    profile = Profile(2, [0.9, 0.8], stats)
    lengths = [4] * 7 + [100]
    out = modelled_makespans(lengths, profile, [0.9, 0.8], [1, 2])
    assert out["none"] == pytest.approx((4 * 12.0 + 96 * 10.0) / 1000)  # 4 steps at 8, 96 alone
    assert out["best K per batch size"] < min(out["none"], out["K=1"], out["K=2"])
    assert modelled_makespans([], profile, [0.9, 0.8], [1])["none"] == 0.0


def test_rate_spans_at_least_the_window_so_long_steps_show():
    from dynaspec.bench.rollout import _rate

    series = [(1.0, 4, 0, 10), (4.0, 4, 0, 40), (4.5, 3, 0, 50)]  # the second step took 3 s > 2 s
    assert _rate(series, 2.0) == pytest.approx([10.0, 10.0, 40 / 3.5])


def test_longest_step_is_the_longest_gap_from_the_start():
    from dynaspec.bench.rollout import longest_step

    series = [(1.0, 4, 0, 10), (4.0, 4, 0, 40), (4.5, 3, 0, 50)]  # steps of 1, 3 and 0.5 s
    assert longest_step(series) == pytest.approx(3.0)
    assert longest_step([(2.5, 1, 0, 1)]) == pytest.approx(2.5) and longest_step([]) == 0.0


def test_longtail_lengths_follow_sigma_and_seed():
    import argparse

    from dynaspec.bench.rollout import lengths_for

    def draw(sigma, seed=0):
        args = argparse.Namespace(
            lengths="longtail", median_tokens=32, length_sigma=sigma, max_tokens=1024, rollout_seed=seed
        )
        return lengths_for(args, 64)

    assert draw(0.0) == [32] * 64  # no spread: every request at the median
    assert draw(1.2) == draw(1.2) and draw(1.2) != draw(1.2, seed=1)  # a seed fixes the draw
    assert max(draw(1.2)) > max(draw(0.8)) and max(draw(1.2)) <= 1024  # a longer tail, capped


def test_rollout_with_auto_uses_the_engines_own_profile_and_the_chosen_policies(
    tmp_path, target_dir, monkeypatch, capsys
):
    """A spec saying "auto" takes the profile an engine with that config makes (here a stand-in for
    the real, minutes-long profile), runs only the policies asked for, and reports each round's
    speed-up over none, none's spread and the K chosen per load."""
    import dynaspec.engine.profiler as profiler
    from dynaspec.kpolicy.profile import load_profile

    profile, prompts = tiny_inputs(tmp_path)
    asked = []

    def stand_in(engine, spec):
        asked.append((spec.dynamic_config_path, spec.num_speculative_tokens))
        return load_profile(profile)

    monkeypatch.setattr(profiler, "auto_profile", stand_in)
    result = tmp_path / "rollout.json"
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_min": 1,
        "dynamic_config_path": "auto",
    }
    rc = main(
        [
            "bench", "rollout", "--model", str(target_dir), "--dtype", "float32",
            "--kv-cache-memory-gb", "0.02", "--speculative-config", json.dumps(spec),
            "--dataset", str(prompts), "--num-prompts", "4", "--lengths", "longtail",
            "--median-tokens", "6", "--max-tokens", "16", "--fixed-ks", "2", "--policies", "per-request",
            "--rounds", "2", "--result-file", str(result),
        ]
    )  # fmt: skip
    assert rc == 0 and asked == [("auto", 2)]
    rows = {r["config"]: r for r in json.loads(result.read_text())["rows"]}
    assert set(rows) == {"none", "K=2", "per-request"}
    for r in rows.values():
        assert len(r["vs_none_by_round"]) == 2 and all(x > 0 for x in r["vs_none_by_round"])
        steps = sum(n for b in r["k_by_running"] for n in b["steps_by_k"].values())
        assert steps == sum(len(rnd["series"]) for rnd in r["rounds"])  # every step counted once
    assert rows["none"]["vs_none_by_round"] == [1.0, 1.0]
    assert all(set(b["steps_by_k"]) <= {"0", "2"} for b in rows["K=2"]["k_by_running"])
    out = capsys.readouterr().out
    assert "run-to-run spread, a configuration's makespan between rounds: none " in out
    assert all(0 <= r["spread_between_rounds"] < 2 for r in rows.values())
    assert "per-request: K chosen, steps by running requests" in out


def test_rollout_refuses_unknown_policies_and_a_profile_beside_auto(tmp_path, target_dir, capsys):
    profile, prompts = tiny_inputs(tmp_path)
    base = ["bench", "rollout", "--model", str(target_dir), "--dataset", str(prompts), "--num-prompts", "2"]
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert main([*base, "--speculative-config", json.dumps(ngram), "--policies", "goodput,fastest"]) == 2
    assert "--policies: unknown fastest" in capsys.readouterr().err
    auto = json.dumps({**ngram, "dynamic_config_path": "auto"})
    assert main([*base, "--speculative-config", auto, "--profile", str(profile)]) == 2
    err = capsys.readouterr().err
    assert '--profile: the speculative config already says "dynamic_config_path": "auto"' in err


def test_spread_of_is_the_range_over_the_mean():
    from dynaspec.bench.rollout import spread_of

    assert spread_of([90.0, 110.0]) == pytest.approx(0.2) and spread_of([5.0]) == 0.0


def test_k_by_running_counts_steps_per_load_range():
    from dynaspec.bench.rollout import format_k_by_running, k_by_running

    series = [[(0.1, 8, 0, 0), (0.2, 8, 1, 8), (0.3, 3, 5, 20)], [(0.1, 1, 5, 6), (0.2, 3, 5, 12)]]
    buckets = k_by_running(series)
    assert buckets == [
        {"running": [1, 1], "steps_by_k": {"5": 1}},
        {"running": [3, 4], "steps_by_k": {"5": 2}},
        {"running": [5, 8], "steps_by_k": {"0": 1, "1": 1}},
    ]
    table = format_k_by_running(buckets)
    assert "5-8" in table and "K=0:1 K=1:1" in table and "0.50" in table
