"""`dynaspec bench serve` against a real speculative server on loopback."""

import json

from support.server import running_server

from dynaspec.cli import main


def test_bench_serve_reports_and_writes_json(target_dir, tmp_path, capsys):
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3}
    out = tmp_path / "serve.json"
    with running_server(target_dir, speculative_config=spec) as (base, _):
        rc = main(
            [
                "bench",
                "serve",
                "--base-url",
                base,
                "--dataset",
                "mtbench",
                "--num-prompts",
                "6",
                "--max-concurrency",
                "3",
                "--max-tokens",
                "10",
                "--result-file",
                str(out),
            ]
        )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Acceptance length:" in printed
    result = json.loads(out.read_text())["result"]
    assert result["successful_requests"] == 6 and result["failed_requests"] == 0
    assert result["output_throughput"] > 0 and result["ttft_ms"]["median"] > 0
    assert result["speculative"]["acceptance_length"] > 1.0
    assert len(result["speculative"]["acceptance_rate_per_pos"]) == 3
