"""The short chaos soak (`tandem chaos`, tandem/tools/chaos.py) over real processes: the supervised
stack on the tiny random Llama, three sessions, a fault every few seconds of every kind the long
soak uses. Nothing may be lost, duplicated, silently truncated or wrong; every failure is an
explicit gRPC status; nothing leaks."""

from __future__ import annotations

import json

import pytest

from tandem.tools.chaos import FAULTS, ChaosConfig, run_chaos, table

PROMPTS = ("the answer is the answer is", "one two three one two three", "a b c a b c a b")


@pytest.mark.slow
def test_a_short_soak_under_every_kind_of_fault(tiny_dir, tmp_path) -> None:
    out = tmp_path / "chaos.json"
    events = []
    report = run_chaos(ChaosConfig(model=str(tiny_dir), duration_s=30, sessions=3, turns=3, max_tokens=64,
                                   fault_every_s=3, seed=3, prompts=PROMPTS, verifier_threads=1,
                                   startup_timeout_s=120),  # the default GEMM mode
                       on_event=events.append, out=out)
    assert json.loads(out.read_text())["requests"] == report["requests"]
    summary = dict(table(report))
    assert report["requests"] >= 20, summary
    assert len(report["faults"]) >= 6 and len(report["fault_counts"]) >= 4, report["faults"]
    assert report["silent_truncations"] == 0, summary
    assert report["greedy_mismatches"] == 0, summary
    assert report["lost_or_duplicated_tokens"] == 0, summary
    assert report["completed"] + report["failed_explicit"] == report["requests"]
    assert report["completed"] > report["failed_explicit"], summary
    assert not any(v is None or v for v in report["leaks"].values()), report["leaks"]
    assert report["ok"]
    assert sum(report["restarts"].values()) >= 1 and any("is back" in e for e in events)


def test_the_fault_names_are_what_the_cli_offers() -> None:
    from typer.testing import CliRunner

    from tandem.tools.cli import app

    res = CliRunner().invoke(app, ["chaos", "--faults", "kill-verifier,set-fire"])
    assert res.exit_code != 0 and "set-fire" in res.output
    assert {"kill-verifier", "term-verifier", "pause-verifier", "kill-valkey", "drop-drafter-link"} <= set(FAULTS)
