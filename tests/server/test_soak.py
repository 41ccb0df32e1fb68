"""`dynaspec bench soak` for 40 s against a real `dynaspec serve` (tiny model, n-gram speculation under
the goodput policy): the mixed traffic, bad requests included, leaves no 5xx, no traceback, no KV block
and no request behind, and every greedy answer equals the same request's answer alone."""

import json

import pytest

from dynaspec.cli import main
from dynaspec.kpolicy.profile import Profile, save_profile

pytestmark = pytest.mark.slow

TIMING_CHECKS = ("p99 last tenth",)  # latency drift: a figure for the record, not a test's verdict


def goodput_ngram(tmp_path) -> dict:
    """n-gram speculation with K chosen by the goodput policy from a profile where drafting pays."""
    stats = {bs: {k: 10.0 + 0.5 * k * bs for k in range(4)} for bs in (1, 2, 4, 8)}
    save_profile(Profile(3, [0.8, 0.7, 0.6], stats), tmp_path / "profile.json")
    return {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "dynamic_config_path": str(tmp_path / "profile.json"),
    }


def test_soak_leaves_nothing_behind(target_dir, tmp_path, capsys):
    out = tmp_path / "soak.json"
    server_args = "--dtype float32 --kv-cache-memory-gb 0.02 --max-model-len 512 --served-model-name tiny"
    rc = main(
        [
            "bench",
            "soak",
            "--model",
            str(target_dir),
            "--speculative-config",
            json.dumps(goodput_ngram(tmp_path)),
            "--server-args",
            server_args,
            "--duration-s",
            "40",
            "--warmup-s",
            "10",
            "--concurrency",
            "4",
            "--sample-every-s",
            "2",
            "--max-tokens",
            "16",
            "--prompt-chars",
            "200",
            "--greedy-prompts",
            "2",
            "--result-file",
            str(out),
            "--no-progress",
        ]
    )
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    checks = {c["name"]: c for c in result["checks"]}
    failed = [
        c for c in result["checks"] if c["passed"] is not True and not c["name"].startswith(TIMING_CHECKS)
    ]
    assert not failed, (failed, result["failures"], printed[-3000:])
    assert rc == (1 if any(c["passed"] is False for c in checks.values()) else 0)
    assert "greedy answers identical to alone" in printed and (tmp_path / "soak.png").is_file()

    kinds = result["kinds"]
    assert {"greedy", "sampled", "scoring", "disconnect"} <= set(kinds), kinds
    assert sum(n for kind, n in kinds.items() if kind.startswith("bad:")) >= 5, kinds
    assert "500" not in result["statuses"] and result["statuses"].get("200", 0) >= 20
    samples = result["samples"]
    assert max(s["kv_cache_usage"] for s in samples) > 0  # the load held KV blocks, and gave them all back
    assert samples[-1]["kv_cache_usage"] == 0 and samples[-1]["running"] == samples[-1]["waiting"] == 0
    assert any(s["k_by_batch_size"] for s in samples)  # speculation on: the policy chose K
    assert all(s["rss_bytes"] for s in samples)  # /metrics reports the server's RSS
    assert result["references"] == 2 * (4 + 2)  # 2 prompts: 4 completion variants, 2 chat ones
    log = (tmp_path / "soak_server.log").read_text()
    assert "Traceback" not in log and '"POST /v1/completions" 400' in log
