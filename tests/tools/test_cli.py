"""The `tandem` command line, run in-process on a tiny model saved to disk.

The commands must parse what they document, fail with a message a user can act on, and print what
scripts read (generate --json, bench --out); generate's tokens must be the target's own.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import typer
from typer.testing import CliRunner

from conftest import make_tiny_tokenizer
from tandem.contract.params import SamplingParams, SpecConfig
from tandem.engine.model.gemm import GemmSettings
from tandem.engine.model.loading import load_model
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.scheduler.generate import Engine
from tandem.tools.cli import app

# Rich wraps help text to the terminal: wide enough that no option name is cut with an ellipsis.
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
THREADS = ["--threads", "1"]  # the CLI sets torch's thread count for the process; keep the suite's

EXPECTED_OPTIONS = {
    "generate": [
        "--prompt", "-p", "--system", "--draft", "--model", "-m", "--draft-model", "--max-new-tokens", "-n",
        "--temperature", "-t", "--top-p", "--top-k", "--seed", "--max-draft-tokens", "-k", "--adaptive",
        "--fixed", "--json", "--threads", "--precision",
    ],
    "bench": [
        "--dataset", "-d", "--limit", "-l", "--max-new-tokens", "-n", "--modes", "--out", "-o", "--model", "-m",
        "--draft-model", "--temperature", "-t", "--seed", "--max-draft-tokens", "-k", "--adaptive", "--fixed",
        "--repeats", "--threads", "--precision",
    ],
    "convert": ["--model", "-m"],
}
COMMANDS = sorted(typer.main.get_command(app).commands)  # every command, the service ones included

GENERATE_KEYS = {"text", "token_ids", "drafted", "accepted", "steps", "mean_accepted_len", "tokens_per_s"}
BENCH_MODE_KEYS = {
    "tokens", "seconds", "tokens_per_s", "speedup_vs_ar", "acceptance_rate", "mean_accepted_len", "lossless",
}
BENCH_PROMPT_MODE_KEYS = {
    "tokens", "seconds", "tokens_per_s", "drafted", "accepted", "steps", "mean_accepted_len", "equal_to_ar",
}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=ENV)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """A command without --threads sets torch's threads to every core, process-wide: restore them."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    GemmSettings.configure("invariant")  # the default; `tandem --gemm PATH` sets it process-wide, like the threads


# --- help -----------------------------------------------------------------------------------------


def test_top_level_help_lists_every_command() -> None:
    res = invoke("--help")
    assert res.exit_code == 0, res.output
    for command in COMMANDS:
        assert re.search(rf"\b{command}\b", res.stdout), command
    assert "lossless speculative decoding" in res.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_mentions_every_option(command) -> None:
    res = invoke(command, "--help")
    assert res.exit_code == 0, res.output
    # What the code declares (so a new option cannot go undocumented) ...
    click_command = typer.main.get_command(app).commands[command]
    declared = {opt for p in click_command.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-")}
    # ... and what users rely on (so an option cannot silently disappear).
    assert set(EXPECTED_OPTIONS.get(command, [])) <= declared
    for opt in sorted(declared):  # as a whole word: "-n" inside "--max-new-tokens" does not count
        assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", res.stdout), f"{command} --help lacks {opt}"


# --- generate -------------------------------------------------------------------------------------


def test_generate_json_prints_one_object_with_the_targets_tokens(tiny_dir) -> None:
    res = invoke(
        "generate", "--model", str(tiny_dir), "--prompt", "the cat is on the mat", "--json",
        "--max-new-tokens", "8", "--draft", "ngram", "--fixed", "-k", "4", *THREADS,
    )
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, res.stdout
    out = json.loads(lines[0])
    assert GENERATE_KEYS <= set(out)
    assert len(out["token_ids"]) == 8 and out["steps"] + out["accepted"] >= 8
    assert out["mean_accepted_len"] == pytest.approx((out["accepted"] + out["steps"]) / out["steps"], abs=1e-4)
    # Lossless through the command line: the tokens of plain greedy decoding, and their text.
    target = load_model(str(tiny_dir), progress=False)
    ctx = apply_chat_template(target.tokenizer, [{"role": "user", "content": "the cat is on the mat"}])
    plain = Engine(target).generate(ctx, SamplingParams(max_new_tokens=8), SpecConfig(strategy="none"))
    assert out["token_ids"] == plain.token_ids
    assert out["text"] == target.tokenizer.decode(plain.token_ids, skip_special_tokens=True)


def test_generate_streams_text_and_reports_statistics(tiny_dir) -> None:
    res = invoke("generate", "-m", str(tiny_dir), "-p", "the cat", "-n", "6", "--draft", "none", *THREADS)
    assert res.exit_code == 0, res.output
    target = load_model(str(tiny_dir), progress=False)
    ctx = apply_chat_template(target.tokenizer, [{"role": "user", "content": "the cat"}])
    ids = Engine(target).generate(ctx, SamplingParams(max_new_tokens=6), SpecConfig(strategy="none")).token_ids
    assert res.stdout.strip() == target.tokenizer.decode(ids, skip_special_tokens=True).strip()
    assert "6 tokens" in res.stderr and "target steps" in res.stderr


def test_seeded_generate_replays(tiny_dir) -> None:
    args = ["generate", "-m", str(tiny_dir), "-p", "the cat", "-n", "8", "--json", "-t", "1.0", "--seed", "3", *THREADS]
    first = json.loads(invoke(*args).stdout)
    assert json.loads(invoke(*args).stdout)["token_ids"] == first["token_ids"]


def test_draft_model_strategy_without_a_draft_model_fails_clearly(tiny_dir) -> None:
    res = invoke("generate", "--model", str(tiny_dir), "--prompt", "hi", "--draft", "model", *THREADS)
    assert res.exit_code == 2
    assert "--draft-model" in res.stderr and "error" in res.stderr
    assert res.stdout == ""


def test_a_draft_with_another_tokenizer_is_refused(tmp_path, tiny_dir, tiny_draft_loaded) -> None:
    other = tmp_path / "other-draft"
    tiny_draft_loaded.model.save_pretrained(str(other))
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(["zebra"])  # one entry more: no longer the target's vocabulary
    tokenizer.save_pretrained(str(other))
    res = invoke("generate", "-m", str(tiny_dir), "-p", "hi", "--draft", "model", "--draft-model", str(other), *THREADS)
    assert res.exit_code == 2
    assert "does not share the tokenizer" in res.stderr and "other-draft" in res.stderr and "tiny-llama" in res.stderr


def test_a_missing_model_fails_clearly(tmp_path) -> None:
    res = invoke("generate", "-m", str(tmp_path / "nowhere"), "-p", "hi", *THREADS)
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_a_draft_model_through_the_cli_is_lossless(tiny_dir, tmp_path, tiny_draft_loaded) -> None:
    draft = tmp_path / "tiny-draft"
    tiny_draft_loaded.model.save_pretrained(str(draft))
    make_tiny_tokenizer().save_pretrained(str(draft))
    args = ["generate", "-m", str(tiny_dir), "-p", "the dog", "-n", "8", "--json", *THREADS]
    plain = json.loads(invoke(*args, "--draft", "none").stdout)
    res = invoke(*args, "--draft", "model", "--draft-model", str(draft), "--fixed", "-k", "3")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["token_ids"] == plain["token_ids"] and out["drafted"] > 0


# --- bench and convert ----------------------------------------------------------------------------


def test_bench_writes_the_documented_report(tiny_dir, tmp_path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "prompt": "def add ( a , b ) : return a + b def sub ( a , b ) :"},
                {"id": "b", "turns": ["the cat is on the mat and the cat is on the"]},
                {"id": "c", "prompt": "never read: past the limit"},
            ]
        )
        + "\n"
    )
    report = tmp_path / "out" / "bench.json"
    res = invoke(
        "bench", "--model", str(tiny_dir), "--dataset", str(dataset), "--limit", "2", "--max-new-tokens", "8",
        "--modes", "ar,ngram", "--out", str(report), *THREADS,
    )
    assert res.exit_code == 0, res.output
    assert res.stdout == "", "with --out (and no --json) the report goes only to the file"
    result = json.loads(report.read_text())
    assert set(result) >= {"modes", "prompts", "config"}
    assert set(result["modes"]) == {"ar", "ngram"}
    for mode in result["modes"].values():
        assert BENCH_MODE_KEYS <= set(mode)
        assert mode["tokens"] == 16 and mode["lossless"] == 1.0
    assert [p["id"] for p in result["prompts"]] == ["a", "b"]
    for prompt in result["prompts"]:
        assert set(prompt["modes"]) == {"ar", "ngram"}
        for m in prompt["modes"].values():
            assert BENCH_PROMPT_MODE_KEYS <= set(m) and m["equal_to_ar"] is True
    cfg = result["config"]
    assert cfg["model"] == "tiny-llama" and cfg["limit"] == 2 and cfg["max_new_tokens"] == 8
    assert cfg["dataset"] == str(dataset) and cfg["machine"]["torch_threads"] == 1
    # every report names its machine and carries the cost curve measured before the run
    curve = cfg["machine"]["cost_curve"]
    assert cfg["machine"]["cpu"] == curve["cpu"] != "" and cfg["machine"]["gemm"] == "invariant"
    assert set(curve["curve_ms"]) == {"100", "1000"} and curve["bound_ms"] > 0


def test_bench_under_a_grammar(tiny_dir, tmp_path) -> None:
    """--response-format: every mode runs under the grammar, lossless against constrained plain
    decoding; a schema file works too; transformers' modes are refused with it."""
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(json.dumps({"prompt": "json tool call name arguments value"}) + "\n")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]}))
    for fmt in ("json_object", str(schema)):
        report = tmp_path / "g.json"
        res = invoke("bench", "-m", str(tiny_dir), "-d", str(dataset), "-n", "12", "--modes", "ar,ngram",
                     "--no-curve", "--response-format", fmt, "--out", str(report), *THREADS)
        assert res.exit_code == 0, res.output
        result = json.loads(report.read_text())
        assert result["config"]["response_format"] == fmt and result["modes"]["ngram"]["lossless"] == 1.0
    res = invoke("bench", "-m", str(tiny_dir), "-d", str(dataset), "--modes", "ar,hf-ar", "--no-curve",
                 "--response-format", "json_object", *THREADS)
    assert res.exit_code == 2 and "hf-" in res.stderr
    res = invoke("bench", "-m", str(tiny_dir), "-d", str(dataset), "--response-format", "yaml", *THREADS)
    assert res.exit_code == 2 and "json_object" in res.stderr


def test_bench_refuses_bad_tools_options(tiny_dir, tmp_path) -> None:
    """--tools: an unknown value, a grammar of its own beside --response-format, and API tools
    through a remote stack are each refused with the reason (before any request is sent)."""
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(json.dumps({"prompt": "hi"}) + "\n")
    base = ("bench", "-m", str(tiny_dir), "-d", str(dataset), "--no-curve", *THREADS)
    res = invoke(*base, "--tools", "sometimes")
    assert res.exit_code == 2 and "--tools is one of prompt, auto, required" in res.stderr
    res = invoke(*base, "--tools", "required", "--response-format", "json_object")
    assert res.exit_code == 2 and "brings its own grammar" in res.stderr
    res = invoke(*base, "--tools", "auto", "--endpoint", "127.0.0.1:9")
    assert res.exit_code == 2 and "runs in process" in res.stderr


def test_bench_mode_tenants_are_checked_before_any_request(tiny_dir, tmp_path) -> None:
    """--mode-tenants: only with --endpoint, not beside --api-key, and every mode needs a tenant of
    its own with a key in full; each refusal names the reason before a request is sent."""
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(json.dumps({"prompt": "hi"}) + "\n")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"ar": {"keys": ["sk-bench-ar-0123456789abcdef"]},
                                            "ngram": {"keys": ["sha256:" + "0" * 64]}}}))
    base = ("bench", "-d", str(dataset), "--modes", "ar,ngram", "--no-curve", "--mode-tenants", str(keys))
    res = invoke(*base, "-m", str(tiny_dir), *THREADS)
    assert res.exit_code == 2 and "is for a stack (--endpoint)" in res.stderr
    closed = f"127.0.0.1:{_closed_port()}"
    res = invoke(*base, "--endpoint", closed, "--api-key", "sk-bench-ar-0123456789abcdef")
    assert res.exit_code == 2 and "leave out --api-key" in res.stderr
    res = invoke(*base, "--endpoint", closed)
    assert res.exit_code == 2 and "no tenant 'ngram' with a key given in full" in res.stderr


def test_bench_refuses_an_unknown_mode(tiny_dir, tmp_path) -> None:
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(json.dumps({"prompt": "hi"}) + "\n")
    res = invoke("bench", "-m", str(tiny_dir), "-d", str(dataset), "--modes", "ar,eagle", *THREADS)
    assert res.exit_code == 2 and "eagle" in res.stderr


# --- calibrate ------------------------------------------------------------------------------------


def test_calibrate_prints_the_curve_the_bound_and_the_gemm_plan(tiny_dir, tmp_path) -> None:
    out = tmp_path / "curve.json"
    res = invoke("calibrate", "-m", str(tiny_dir), "--contexts", "10,40", "--json", "--out", str(out), *THREADS)
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout)
    assert record == json.loads(out.read_text())
    assert record["model"] == "tiny-llama" and record["cpu"] and record["threads"] == 1
    assert list(record["curve_ms"]) == ["10", "40"]
    for row in record["curve_ms"].values():
        assert list(row) == ["1", "2", "3", "5", "9", "17"] and all(ms > 0 for ms in row.values())
    assert record["read_gbs"] > 0 and record["bound_ms"] == pytest.approx(record["weight_mb"] / record["read_gbs"], rel=0.01, abs=1e-3)
    assert record["ratios"]["10"]["one_over_bound"] == pytest.approx(record["curve_ms"]["10"]["1"] / record["bound_ms"], rel=0.02)
    assert record["gemm"] and all(len(paths) == 18 for paths in record["gemm"].values())
    # the KV cache a step reads: layers x (keys + values) x KV heads x head size x context x 4 bytes
    cfg = json.loads((tiny_dir / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"] * 4
    assert record["kv_mb"] == {"10": pytest.approx(10 * per_token / 1e6, abs=1e-3), "40": pytest.approx(40 * per_token / 1e6, abs=1e-3)}
    with_kv = (record["weight_mb"] + record["kv_mb"]["40"]) / record["read_gbs"]
    assert record["ratios"]["40"]["one_over_kv_bound"] == pytest.approx(record["curve_ms"]["40"]["1"] / with_kv, rel=0.02)
    assert record["attention"]
    assert "GEMM paths" in res.stderr and "forward ms by new tokens" in res.stderr


def test_a_forced_gemm_path_reaches_every_weight(tiny_dir) -> None:
    res = invoke("--gemm", "mkl_nn", "calibrate", "-m", str(tiny_dir), "--contexts", "8", "--json", *THREADS)
    assert res.exit_code == 0, res.output
    assert {p for paths in json.loads(res.stdout)["gemm"].values() for p in paths} == {"mkl_nn"}


@pytest.mark.parametrize("args, message", [
    (["--gemm", "fastest", "calibrate"], "unknown GEMM mode 'fastest'"),
    (["calibrate", "--contexts", "100,lots"], "--contexts must be positive integers"),
    (["calibrate", "--contexts", "0"], "--contexts must be positive integers"),
])
def test_calibrate_refuses_bad_options(args, message, tiny_dir) -> None:
    res = invoke(*args, "-m", str(tiny_dir), *THREADS)
    assert res.exit_code == 2 and message in res.stderr, res.output


def test_convert_leaves_a_hf_directory_alone(tiny_dir) -> None:
    res = invoke("convert", "--model", str(tiny_dir))
    assert res.exit_code == 0 and "nothing to convert" in res.stdout


# --- loadtest ---------------------------------------------------------------------------------------

def _closed_port() -> int:
    """A loopback port that nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_loadtest_that_reaches_nothing_says_why_and_fails(tmp_path) -> None:
    """A workload by name resolves, and a phase whose every request failed is not a measurement:
    the reason is printed and the exit status says so (the report is still written)."""
    out = tmp_path / "lt.json"
    res = invoke("loadtest", "--endpoint", f"127.0.0.1:{_closed_port()}", "-d", "agent_tools", "-c", "1",
                 "--turns", "1", "--limit", "1", "--duration", "5", "--out", str(out))
    assert res.exit_code == 2, res.output
    assert "every request failed" in res.stderr and "ConnectError" in res.stderr, res.stderr
    report = json.loads(out.read_text())
    assert [r["errors"] for r in report["results"]] == [1, 1]
    assert all("ConnectError" in r["top_error"] for r in report["results"])


def test_loadtest_names_the_workloads_when_the_set_is_unknown() -> None:
    res = invoke("loadtest", "--endpoint", "127.0.0.1:1", "-d", "no_such_set")
    assert res.exit_code == 2 and "agent_tools" in res.stderr and "mt_bench" in res.stderr, res.output
