"""`tandem up`'s options reach the services they are for (the stack itself is tested in
test_supervision.py and test_stack_security.py)."""

from __future__ import annotations

from typer.testing import CliRunner

from tandem.tools import cli


def _config(monkeypatch, *args: str):
    seen = []
    monkeypatch.setattr(cli, "_run_stack", lambda config, demo_request: seen.append(config))
    res = CliRunner().invoke(cli.app, ["up", *args])
    assert res.exit_code == 0, res.output
    return seen[0]


def test_verifier_max_sessions_goes_to_every_verifier(monkeypatch) -> None:
    assert _config(monkeypatch, "--verifier-max-sessions", "256").verifier_args == ("--max-sessions", "256")
    assert _config(monkeypatch).verifier_args == ()  # the verifier's own default


def test_a_verifier_max_sessions_below_one_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(cli, "_run_stack", lambda config, demo_request: None)
    res = CliRunner().invoke(cli.app, ["up", "--verifier-max-sessions", "0"])
    assert res.exit_code != 0
    assert "verifier-max-sessions" in res.output
