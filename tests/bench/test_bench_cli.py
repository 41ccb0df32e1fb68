"""`dynaspec bench decode` and `bench spec` run end to end on tiny models (transformers included)."""

import json
import re
from pathlib import Path

import torch

from dynaspec.cli import main
from dynaspec.kpolicy.profile import Profile, save_profile
from dynaspec.models.config import ModelConfig
from dynaspec.provenance import git_commit


def test_bench_decode_tiny(tmp_path, target_dir):
    out = tmp_path / "decode.json"
    rc = main(
        [
            "bench",
            "decode",
            "--model",
            str(target_dir),
            "--dataset",
            "mtbench",
            "--batch-sizes",
            "1,2",
            "--max-tokens",
            "6",
            "--dtype",
            "float32",
            "--engines",
            "dynaspec,transformers",
            "--result-file",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["batch_size"] for r in report["rows"]] == [1, 2]
    for r in report["rows"]:
        assert r["dynaspec_decode_tokens_per_s"] > 0 and r["transformers_decode_tokens_per_s"] > 0
        assert 0 <= r["greedy_tokens_agreeing_prefix"]["transformers"] <= r["greedy_tokens_total"]
    assert report["environment"]["torch"]
    assert report["environment"]["commit"] == git_commit()
    if (Path(__file__).parents[2] / ".git").exists():  # a clone: the figure names its commit
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", report["environment"]["commit"])


def test_bench_decode_at_a_long_context(tmp_path, target_dir, capsys):
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", str(target_dir), "--batch-sizes", "2", "--max-tokens", "5"]
    argv += ["--dtype", "float32", "--engines", "dynaspec,transformers", "--result-file", str(out)]
    assert main([*argv, "--context", "200"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["dynaspec_decode_tokens_per_s"] > 0 and row["transformers_decode_tokens_per_s"] > 0
    # both engines decode the same 200-token texts: greedy float32 outputs agree
    assert row["greedy_tokens_agreeing_prefix"]["transformers"] == row["greedy_tokens_total"] == 10
    assert main([*argv, "--context", "-1"]) != 0
    assert "--context: must be >= 0, got -1" in capsys.readouterr().err


def test_bench_spec_tiny(tmp_path, target_dir):
    out = tmp_path / "spec.json"
    # an EAGLE-3 head of random weights beside the draft model and n-gram (--eagle3)
    from dynaspec.train import eagle3

    target = ModelConfig.from_hf_dict(json.loads((target_dir / "config.json").read_text()))
    config = eagle3.head_config(target, 64, 32)
    head = tmp_path / "head"
    model = eagle3.TrainableEagle3(config)
    eagle3.write_checkpoint(model, config, torch.arange(64), target.vocab_size, head, {"target": "tiny"})
    # the drafters with suffix drafts beside them (--with-suffix), goodput on a profile of its own
    profile = tmp_path / "profile.json"
    save_profile(Profile(2, [0.8, 0.7], {1: {0: 10.0, 1: 12.0, 2: 14.0}}), profile)
    rc = main(
        [
            "bench",
            "spec",
            "--model",
            str(target_dir),
            "--draft",
            str(target_dir),
            "--dataset",
            "humaneval",
            "--num-prompts",
            "2",
            "--max-tokens",
            "8",
            "--ks",
            "1,3",
            "--ngram-k",
            "2",
            "--draft-vocab-size",
            "0",
            "--draft-context-window",
            "0",
            "--draft-quantization",
            "none",  # the target's own weights, so that it drafts exactly what it verifies
            "--eagle3",
            str(head),
            "--eagle-k",
            "1,2",
            "--with-suffix",
            "--suffix-profile",
            str(profile),
            "--dtype",
            "float32",
            "--result-file",
            str(out),
        ]
    )
    assert rc == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        "dynaspec plain",
        "dynaspec K=1",
        "dynaspec K=3",
        "dynaspec ngram K=2",
        "dynaspec eagle3 K=1",
        "dynaspec eagle3 K=2",
        "dynaspec draft+suffix goodput",
        "dynaspec eagle3+suffix goodput",
        "transformers plain",
        "transformers assisted",
    }
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    # lossless: every dynaspec configuration reproduces plain greedy output
    assert all(rows[c]["outputs_identical_to_dynaspec_plain"] == 2 for c in rows if c.startswith("dynaspec"))
    assert rows["dynaspec K=3"]["acceptance_length"] >= 3.0  # the target drafting for itself
