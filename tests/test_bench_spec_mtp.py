"""`agentbox bench spec` with the MTP head: on the tiny Qwen3.5 whose head is trained on its own greedy outputs
(tests/mtp_models.py), decode with `--speculative mtp` against without, on prose (where a text match drafts
nothing) and on an edit-shaped prompt, from token-id workloads; outputs the same, the head's accepted tokens per
step reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mtp_models import trained_checkpoint
from typer.testing import CliRunner

from agentbox.bench.spec import spec_report
from agentbox.cli.main import app
from agentbox.config import Speculative


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[int]]]:
    path = tmp_path_factory.mktemp("qwen3_5_mtp_bench")
    _, workloads, _, _ = trained_checkpoint(path)
    return path, workloads


def test_bench_spec_reports_the_heads_accepted_tokens_per_step(bench_model) -> None:  # noqa: ANN001
    path, workloads = bench_model
    report = spec_report(str(path), Speculative.MTP, max_tokens=40, repeats=1, workloads=workloads)
    assert report["drafters"] == "mtp" and set(report["workloads"]) == {"prose", "edit"}
    for name, w in report["workloads"].items():
        assert w["identical_output"] and w["output_tokens"] == 40, name
        mtp = w["drafters"]["mtp"]
        assert mtp["verify_steps"] > 0 and mtp["accepted_per_step"] > 1.0, (name, w)  # trained on these
        assert w["mean_tokens_per_step"] > 1.5 and w["decode_tok_s_off"] > 0, (name, w)


def test_bench_spec_command_reads_token_workloads(bench_model, tmp_path: Path) -> None:  # noqa: ANN001
    path, workloads = bench_model
    (tmp_path / "w.json").write_text(json.dumps({"prose": workloads["prose"]}))
    out = CliRunner().invoke(app, ["bench", "spec", "--model", str(path), "--speculative", "auto", "--max-tokens",
                                   "12", "--repeats", "1", "--workloads", str(tmp_path / "w.json")])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["drafters"] == "suffix+mtp" and set(report["workloads"]["prose"]["drafters"]) == {"suffix", "mtp"}
    (tmp_path / "bad.json").write_text("[1, 2]")
    bad = CliRunner().invoke(app, ["bench", "spec", "--model", str(path), "--workloads", str(tmp_path / "bad.json")])
    assert bad.exit_code != 0 and "token ids" in bad.output
