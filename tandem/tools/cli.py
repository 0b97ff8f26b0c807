"""The `tandem` command line: every entry point of the project, with typed options.

Options are parsed here, once, into typed config objects (`SamplingParams`, `SpecConfig`, service
settings) and passed down; nothing below reads flags or the environment again.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig

app = typer.Typer(
    name="tandem",
    help=(
        "Tandem: lossless speculative decoding. Cheap drafters propose tokens, the target model "
        "verifies a whole block in one forward pass and keeps exactly what it would have produced."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)

log = logging.getLogger("tandem.tools.cli")


@app.callback()
def _global(
    ctx: typer.Context,
    gemm: Annotated[
        str,
        typer.Option("--gemm", envvar="TANDEM_GEMM", show_default=True,
                     help="CPU GEMM path of float32 target forwards. 'invariant' (default): every call on one "
                          "of our row-invariant kernels (tandem_panel with AVX-512, else tandem_gemv), so a "
                          "position's bits never depend on the rows beside it: the same request gives the same "
                          "tokens idle or under load. 'auto' measures the library paths once per machine (cached; "
                          "`tandem calibrate` shows the choice) and picks the fastest per weight shape and row count: "
                          "faster verification blocks and prefill, still lossless against plain decoding, but a prompt "
                          "prefilled in other pieces or batched with other sessions can give other tokens. Or force "
                          "one everywhere (for comparison): mkl_nt, mkl_nn, onednn_b1, onednn_b4, onednn_b16, "
                          "gemv_rows, tandem_gemv, tandem_panel. A GGUF target at its own precision (the default "
                          "model) runs on quant.c, invariant whatever this says."),
    ] = "invariant",
) -> None:
    """Options that apply to every command (set before the command: `tandem --gemm onednn_b4 bench ...`)."""
    if ctx.invoked_subcommand in TORCH_FREE:
        return  # runs no model: the process never imports torch (tests/test_layout.py)
    if "--help" in sys.argv[1:]:
        return  # a command's help runs nothing: answered without importing torch (0.4 s, not 2 s)
    from tandem.engine.model.gemm import GemmSettings

    try:
        GemmSettings.configure(gemm)
    except ValueError as exc:
        _fail(str(exc))

TORCH_FREE = ("gateway",)  # commands whose process never runs a model
STRATEGIES_DEFAULT = ("none", "ngram", "suffix", "hybrid")  # tandem determinism's rotation

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Target model: a Hugging Face causal-LM directory, a .gguf file, or 'default' (the embedded "
        "SmolLM2-135M-Instruct, converted once into the cache).",
    ),
]
DraftModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--draft-model",
        help="Draft model for --draft model / hybrid: a causal LM directory or .gguf sharing the target's "
        "tokenizer (default: the target's draft made by `tandem distill`, when there is one).",
    ),
]
PrecisionOpt = Annotated[
    str,
    typer.Option(
        "--precision",
        help="What the target computes in, which is what 'lossless' is judged against. For a .gguf "
        "model: 'gguf' keeps the file's Q4_0 / Q4_1 / Q8_0 weights as stored and rounds each layer's input "
        "to 8 bits per block of 32, as llama.cpp does (the fastest on a CPU: integer dot products, about a "
        "fifth of float32's bytes per step for Q4_1; needs AVX-512 VNNI or AVX2); 'gguf-float' keeps the weights "
        "but multiplies float32 inputs (closer to the float model, slower; AVX-512); 'float32' dequantizes "
        "the file; 'auto' is the first of gguf, gguf-float, float32 that runs here. Other models run in "
        "their own precision.",
    ),
]
ThreadsOpt = Annotated[
    Optional[int],
    typer.Option("--threads", help="Torch CPU threads for this process (default: all cores).", min=1),
]
MaxDraftOpt = Annotated[
    int,
    typer.Option("--max-draft-tokens", "-k", help="Upper bound on the drafts verified per step.", min=1, max=64),
]
AdaptiveOpt = Annotated[
    bool,
    typer.Option(
        "--adaptive/--fixed",
        help="Adaptive: choose each step's block length from measured acceptance and cost (0 = plain step). "
        "Fixed: always draft --max-draft-tokens.",
    ),
]


LogLevelOpt = Annotated[
    str, typer.Option("--log-level", help="Logging level: debug, info, warning, error.")
]
LogJsonOpt = Annotated[
    bool,
    typer.Option("--log-json/--log-text", envvar="TANDEM_LOG_JSON",
                 help="Log JSON lines (with trace_id and session_id fields) instead of text. Prompt text is "
                      "never logged unless TANDEM_LOG_PROMPTS=1."),
]
MetricsPortOpt = Annotated[
    Optional[int],
    typer.Option("--metrics-port", min=0, max=65535,
                 help="Serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port; default: off)."),
]


def _setup(threads: int | None, log_level: str = "info", *, service: str | None = None,
           log_json: bool | None = None, runs_model: bool = True) -> None:
    """Logging for this process; for a service (`service` = "verifier", ...) also tracing, on when
    the OTEL_* environment asks for it (tandem.serving.telemetry). `runs_model` False: a process
    that runs no model (the gateway), which then never imports torch."""
    from tandem.serving.logs import setup_logging

    setup_logging(log_level, log_json)
    if service is not None:
        from tandem.serving.telemetry import setup_tracing

        setup_tracing(f"tandem-{service}")
    if runs_model:
        import torch

        torch.set_num_threads(threads or os.cpu_count() or 1)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _report(record: dict, out: Path | None, as_json: bool) -> None:
    """A command's JSON record: to `out` (saying so on stderr) and/or stdout."""
    text = json.dumps(record, indent=2)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        typer.echo(f"wrote {out}", err=True)
    if as_json:
        print(text)


def _load(model: str, draft_model: str | None, *, needs_draft: bool = False, precision: str = "auto"):
    """Target and draft. A command that needs a draft and got none takes the target's distilled
    draft from the cache (`tandem distill` writes it there), saying so."""
    from tandem.engine.model.loading import check_same_tokenizer, load_model
    from tandem.engine.model.paths import ModelError, find_default_draft

    try:
        target = load_model(model, precision=precision)
        if needs_draft and not draft_model:
            found = find_default_draft(target.model_id)
            if found is None:
                _fail(f"no draft model: pass --draft-model PATH, or make one for {target.model_id} with "
                      f"`tandem distill --target {model}` (13 minutes for SmolLM2 on 2 Intel Xeon cores, 18 on 2 AMD EPYC cores)")
            draft_model = str(found)
            typer.echo(f"draft model: {found} (distilled for {target.model_id})", err=True)
        draft = load_model(draft_model) if draft_model else None
        if draft is not None:
            check_same_tokenizer(target, draft)
    except ModelError as exc:
        _fail(str(exc))
    return target, draft


class Routing(str, Enum):
    """The gateway's routing policies (tandem/serving/routing.py ROUTING_POLICIES)."""

    residency = "residency"
    round_robin = "round-robin"
    least_loaded = "least-loaded"


RoutingOpt = Annotated[Routing, typer.Option(
    "--routing",
    help="How the gateway picks a verifier: residency (the one holding the session's KV, else the longest "
         "resident prefix, else the least loaded), or a baseline that ignores what verifiers hold: round-robin, "
         "least-loaded (to measure what residency buys).")]
# The strategy of requests that do not choose one (a client that cannot send Tandem's
# `speculation` field: lm-eval, load generators): `none` serves plain decoding.
SpeculationOpt = Annotated[DraftStrategy, typer.Option(
    "--speculation", help="Speculation for requests that do not set their own (`speculation.strategy`): "
    "none (plain decoding), ngram (prompt lookup), model, hybrid.")]


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The user message (chat template applied).")],
    system: Annotated[Optional[str], typer.Option("--system", help="An optional system message.")] = None,
    draft: Annotated[
        DraftStrategy, typer.Option("--draft", help="Proposer: none (plain decoding), ngram (prompt lookup), model "
                                    "(a draft model), hybrid (per step, prompt lookup or the draft model, "
                                    "whichever is expected to commit more tokens per second).")
    ] = DraftStrategy.ngram,
    model: ModelOpt = "default",
    draft_model: DraftModelOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Generate at most this many tokens.", min=1)] = 128,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy; otherwise sample.", min=0.0)] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1 = off).", min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens (0 = off).", min=0)] = 0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed of a sampled request: same seed, same text.", min=0)] = None,
    max_draft_tokens: MaxDraftOpt = 8,
    adaptive: AdaptiveOpt = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")] = False,
    threads: ThreadsOpt = None,
    precision: PrecisionOpt = "auto",
) -> None:
    """Generate a reply on one machine, streaming the text, then print speculation statistics."""
    _setup(threads)
    from rich.console import Console

    from tandem.engine.model.tokenizer import apply_chat_template
    from tandem.engine.scheduler.generate import Engine

    try:
        sampling = SamplingParams(
            temperature=temperature, top_p=top_p if top_p > 0 else 1.0, top_k=top_k, seed=seed,
            max_new_tokens=max_new_tokens,
        )
        spec = SpecConfig(strategy=draft, max_draft_tokens=max_draft_tokens, adaptive=adaptive)
    except ValueError as exc:
        _fail(str(exc))
    target, draft_lm = _load(model, draft_model, needs_draft=draft in (DraftStrategy.model, DraftStrategy.hybrid),
                             precision=precision)
    engine = Engine(target, draft_lm, spec)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    context = apply_chat_template(target.tokenizer, messages)
    from tandem.contract.text import Detokenizer

    stream = Detokenizer(target.tokenizer)

    def on_step(step) -> None:
        if not as_json:
            sys.stdout.write(stream.push(step.tokens))
            sys.stdout.flush()

    try:
        result = engine.generate(context, sampling, spec, on_step=on_step)
    except ValueError as exc:
        _fail(str(exc))
    st = result.stats
    text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if as_json:
        print(json.dumps({
            "text": text,
            "token_ids": result.token_ids,
            "drafted": st.drafted,
            "accepted": st.accepted,
            "steps": st.steps,
            "mean_accepted_len": round(st.mean_accepted_len, 4),
            "acceptance_rate": round(st.acceptance_rate, 4),
            "tokens_per_s": round(result.tokens_per_s, 3),
            "finish_reason": result.finish_reason.value,
            "prompt_tokens": result.prompt_tokens,
            "strategy": draft.value,
            "model": target.model_id,
            "by_proposer": st.by_proposer,
        }))
        return
    sys.stdout.write(stream.push([], final=True) + "\n")
    Console(stderr=True).print(
        f"[bold]{len(result.token_ids)} tokens[/bold] in {result.seconds:.2f} s "
        f"([bold]{result.tokens_per_s:.1f} tok/s[/bold]), {draft.value}: drafted {st.drafted}, "
        f"accepted {st.accepted} ({st.acceptance_rate:.0%}), {st.steps} target steps, "
        f"mean accepted length {st.mean_accepted_len:.2f} tokens/step, finish: {result.finish_reason.value}"
    )


@app.command()
def convert(
    model: ModelOpt = "default",
) -> None:
    """Convert a GGUF model (default: the embedded SmolLM2) into the local safetensors cache, once."""
    _setup(None)
    from tandem.engine.model.loading import convert_gguf
    from tandem.engine.model.paths import ModelError, resolve_model_path

    try:
        _, path = resolve_model_path(model)
    except ModelError as exc:
        _fail(str(exc))
    if path.suffix != ".gguf":
        typer.echo(f"{path} is already a Hugging Face directory; nothing to convert")
        return
    typer.echo(str(convert_gguf(path)))


@app.command()
def calibrate(
    model: ModelOpt = "default",
    contexts: Annotated[str, typer.Option("--contexts", help="Comma-separated context lengths (tokens already in the cache) to measure at.")] = "100,1000,4000",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the JSON record here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON record on stdout (the tables go to stderr).")] = False,
    threads: ThreadsOpt = None,
    precision: PrecisionOpt = "auto",
) -> None:
    """Measure this machine: the target's forward cost at 1-17 new tokens and several contexts, the
    memory bandwidth and the bound it sets on a one-token step, and the GEMM path chosen per shape.

    The first run on a machine also measures the GEMM paths (a few seconds, cached under the tandem
    cache's gemm/ folder); `tandem bench` records the same curve beside its results.
    """
    _setup(threads)
    from rich.console import Console

    from tandem.engine.model.llama import NativeLlama, Unsupported
    from tandem.tools.calibrate import format_curve, format_plan, measure

    try:
        ctx = [int(c) for c in contexts.split(",") if c.strip()]
        if not ctx or min(ctx) < 1:
            raise ValueError
    except ValueError:
        _fail(f"--contexts must be positive integers separated by commas, not {contexts!r}")
    target, _ = _load(model, None, precision=precision)
    try:
        native = NativeLlama(target.model, quantized=target.quantized)
    except Unsupported as exc:
        _fail(f"calibrate measures the native forward, which {target.model_id} cannot use: {exc}")
    curve = measure(native, contexts=tuple(ctx))
    console = Console(stderr=True)
    if native.gemm_plan is not None:
        console.print(format_plan(native.gemm_plan))
    console.print(format_curve(curve))
    _report({"model": target.model_id, **curve.as_dict()}, out, as_json)


@app.command()
def bench(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Prompt set: a bundled development set by name (humaneval, mt_bench, gsm8k, bfcl_multiple), a multi-session workload built from them (agent_tools: 12 two-turn sessions sharing one tool list; code_twice: HumanEval prompts asked twice, renamed the second time; use --turns 2 and --suffix-warm), or a file: MT-Bench/GSM8K (turns), HumanEval (prompt), BFCL (question + function), or any JSONL with prompt / messages / turns and optional category.")],
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="Use the first N prompts.", min=1)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens per generation.", min=1)] = 128,
    modes: Annotated[str, typer.Option("--modes", help="Comma-separated modes: ar (plain decoding, the baseline), ngram (prompt lookup), suffix (suffix decoding: see --suffix-warm), model, hybrid (prompt lookup, suffix decoding or the draft model per step), hybrid-nosuffix (the hybrid without suffix decoding), suffix-chain and hybrid-chain (suffix decoding without token trees) (a draft model: --draft-model, or the target's distilled draft); transformers' generate on the same model as peers: hf-ar (their baseline), hf-prompt-lookup, hf-assisted (needs a draft model too); llama.cpp on the same GGUF file (pip install 'tandem[peers]'): llamacpp (its plain decoding, its family's baseline), llamacpp-lookup (its prompt-lookup decoding).")] = "ar,ngram",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the JSON report here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Also print the JSON report on stdout (the tables go to stderr).")] = False,
    model: ModelOpt = "default",
    draft_model: DraftModelOpt = None,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy (lossless is checked token for token); > 0 samples.", min=0.0)] = 0.0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed of a sampled run (default 0): each prompt and turn gets its own seed, the same in every mode.", min=0)] = None,
    max_draft_tokens: MaxDraftOpt = 8,
    adaptive: AdaptiveOpt = True,
    repeats: Annotated[int, typer.Option("--repeats", help="Runs per prompt and mode; the median-time run counts.", min=1)] = 1,
    turns: Annotated[int, typer.Option("--turns", help="Run up to N user turns of each record in order, as one conversation (1 = first turn only).", min=1)] = 1,
    hf_lookup_tokens: Annotated[int, typer.Option("--hf-lookup-tokens", help="prompt_lookup_num_tokens of the hf-prompt-lookup mode.", min=1)] = 10,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write PNG plots (speedup, acceptance by position, accepted length, tokens/s) into this directory.", file_okay=False)] = None,
    endpoint: Annotated[Optional[str], typer.Option("--endpoint", help="Benchmark a running stack through its gateway's gRPC address (HOST:PORT) instead of in process.")] = None,
    response_format: Annotated[Optional[str], typer.Option("--response-format", help="Constrain every output: 'json_object' (any JSON), or a JSON schema file (strict). Speculation runs under the grammar; the hf-* modes cannot.")] = None,
    tools: Annotated[str, typer.Option("--tools", help="How a record's functions (BFCL sets) reach the model: 'prompt' (a tool list in the system message), or as the API's tools with tool_choice 'auto' or 'required' (rendered as the gateway renders them; 'required' runs under the call grammar, as the gateway does). In process only.")] = "prompt",
    ca: Annotated[Optional[Path], typer.Option("--ca", exists=True, dir_okay=False, help="With --endpoint: the gateway speaks TLS with a certificate from this CA (`tandem up --tls` prints it).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="TANDEM_API_KEY", help="With --endpoint: the gateway's API key.")] = None,
    mode_tenants: Annotated[Optional[Path], typer.Option("--mode-tenants", exists=True, dir_okay=False, help="With --endpoint: the gateway's API key file (docs/security.md) with a tenant named after each mode (ar, ngram, suffix, ...), each with a key given in full. Every conversation is then a session of its mode's tenant: later turns (--turns) reuse its KV, first turns the KV of a prefix an earlier session of the same mode left (a tool list), never another mode's. Without it: one-off requests, first turns only.")] = None,
    curve: Annotated[bool, typer.Option("--curve/--no-curve", help="Measure the machine's cost curve (`tandem calibrate`, 100 and 1,000 tokens of context) before the run and record it in the report (in process only).")] = True,
    threads: ThreadsOpt = None,
    suffix_warm: Annotated[bool, typer.Option("--suffix-warm/--suffix-cold", help="Suffix decoding's cross-session store (modes suffix, hybrid): warm = fed by the finished answers of the earlier prompts of this run (a prompt's own answers join only after all its modes ran); cold = empty. In process only.")] = False,
    share_prefix: Annotated[Optional[bool], typer.Option("--share-prefix/--no-share-prefix", help="In process: a conversation's first turn copies the KV of its longest common prefix (a shared system prompt or tool list) from the conversations of the last few earlier prompts, as a verifier shares its resident sessions' KV, in every mode of ours alike and never from the same prompt. Default: on, unless a peer mode (hf-*, llamacpp*) runs, since the peers prefill every prompt whole.")] = None,
    precision: PrecisionOpt = "auto",
) -> None:
    """Benchmark modes side by side in one process, interleaved per prompt, against plain decoding.

    Reports per mode: tokens/s, speedup_vs_ar (median over prompts of the per-token time ratio to the
    mode's baseline: ar, or hf-ar for transformers' modes), tokens/s relative to hf-ar, acceptance,
    mean accepted length, and lossless (fraction of prompts equal to the baseline's greedy output);
    and the same per category of the prompt set.
    """
    _setup(threads)
    from rich.console import Console

    from tandem.engine.scheduler.generate import Engine
    from tandem.tools.bench import PEER_MODES, TOOL_MODES, format_category_table, format_table, run_bench
    from tandem.tools.datasets import records_for

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    try:
        if tools not in TOOL_MODES:  # before any model loads
            raise ValueError(f"--tools is one of {', '.join(TOOL_MODES)}, not {tools!r}")
        if tools != "prompt" and endpoint:  # before connecting (run_bench refuses it too, after)
            raise ValueError("--tools auto/required runs in process; through --endpoint the records' tool lists go as text")
        if mode_tenants is not None and not endpoint:
            raise ValueError("--mode-tenants is for a stack (--endpoint); in process every conversation is a session already")
        records = records_for(dataset, limit)
        grammar = _grammar_option(response_format)
        if grammar is not None and tools == "required":
            raise ValueError("--tools required brings its own grammar (one call of the record's functions); leave out --response-format")
        if grammar is not None and any(m in PEER_MODES for m in mode_list):
            raise ValueError("--response-format: the peers' modes (hf-*, llamacpp*) run without a grammar; leave them out")
        sampling = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens, grammar=grammar)
        spec = SpecConfig(max_draft_tokens=max_draft_tokens, adaptive=adaptive)
    except ValueError as exc:
        _fail(str(exc))
    try:
        if endpoint:
            from tandem.tools.bench_remote import GatewayTarget, mode_keys_from_file

            mode_keys = None
            if mode_tenants is not None:
                if api_key:
                    raise ValueError("--mode-tenants gives every mode its own key: leave out --api-key")
                mode_keys = mode_keys_from_file(mode_tenants, list(dict.fromkeys(["ar", *mode_list])))
            bench_target = GatewayTarget(endpoint, ca=ca, api_key=api_key, mode_keys=mode_keys)
            result = run_bench(bench_target, records, mode_list, max_new_tokens, sampling=sampling, repeats=repeats,
                               turns=turns, share_prefix=share_prefix)
        else:
            needs = any(m in ("model", "hybrid", "hybrid-nosuffix", "hybrid-chain", "hf-assisted") for m in mode_list)
            target, draft_lm = _load(model, draft_model, needs_draft=needs, precision=precision)
            engine = Engine(target, draft_lm, spec)
            machine_curve = None
            impl = getattr(engine.runner.backend, "impl", None)
            if curve and impl is not None:
                from tandem.tools.calibrate import measure

                # before the run, alone on the machine: the same conditions as the run's figures
                machine_curve = measure(impl, contexts=(100, 1000))
            result = run_bench(engine, records, mode_list, max_new_tokens, tokenizer=target.tokenizer,
                               sampling=sampling, repeats=repeats, turns=turns, hf_lookup_tokens=hf_lookup_tokens,
                               tools=tools, suffix_warm=suffix_warm, share_prefix=share_prefix)
            # what "lossless" was judged against (the hf-* modes run transformers' float32 model)
            result["config"]["precision"] = engine.runner.precision
            if machine_curve is not None:
                result["config"]["machine"]["cost_curve"] = machine_curve.as_dict()
    except ValueError as exc:
        _fail(str(exc))
    result["config"]["dataset"] = str(dataset)
    if response_format:
        result["config"]["response_format"] = response_format
    console = Console(stderr=True)
    if "cost_curve" in result["config"].get("machine", {}):
        from tandem.tools.calibrate import MachineCurve, format_curve

        data = dict(result["config"]["machine"]["cost_curve"])
        data.pop("ratios", None)
        console.print(format_curve(MachineCurve(**data)))
    console.print(format_table(result))
    by_category = format_category_table(result)
    if by_category is not None:
        console.print(by_category)
    _report(result, out, as_json)
    if plot:
        from tandem.tools.plots import write_plots

        for path in write_plots([result], plot):
            typer.echo(f"wrote {path}", err=True)


@app.command()
def distill(
    target: Annotated[str, typer.Option("--target", help="Target model to make a draft for: HF directory, .gguf, or 'default'.")] = "default",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Draft directory to write (default: the cache, where modes model and hybrid find it).", file_okay=False)] = None,
    layers: Annotated[int, typer.Option("--layers", help="Transformer layers of the draft (each costs ~0.65 ms per token for SmolLM2 on 2 cores).", min=1)] = 2,
    hidden: Annotated[Optional[int], typer.Option("--hidden", help="Width of the draft (default: the target's, which reuses its embeddings and starts from its layers; narrower starts from random layers).", min=32)] = None,
    vocab_top: Annotated[int, typer.Option("--vocab-top", help="LM-head rows: the N most frequent ids of the training text (ids outside are never proposed; output stays exact).", min=16)] = 8192,
    tokens: Annotated[int, typer.Option("--tokens", help="Target-generated reply tokens to train on.", min=1)] = 66_000,
    epochs: Annotated[float, typer.Option("--epochs", help="Passes over the training text.", min=0.01)] = 5.5,
    prompts: Annotated[Optional[list[Path]], typer.Option("--prompts", help="Prompt set(s) to generate training text for (repeatable; any format `tandem bench` reads). Default: the four dev sets under --data-dir (first --holdout prompts of each left out), in equal shares.", exists=True, dir_okay=False)] = None,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="Where the development prompt sets live (default: the ones bundled with Tandem).")] = None,
    holdout: Annotated[int, typer.Option("--holdout", help="Leave out the first N prompts of each benchmarked dev set (the benchmarks run those).", min=0)] = 20,
    self_prompts: Annotated[int, typer.Option("--self-prompts", help="User messages the target writes for itself as one more prompt source (open-ended requests the prompt sets lack; 0: none).", min=0)] = 128,
    init_layers: Annotated[Optional[str], typer.Option("--init-layers", help="Comma-separated target layers the draft's layers start from (default: the first --layers layers).")] = None,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW, warmup then cosine).", min=0.0)] = 2e-3,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per training step.", min=1)] = 8,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the data split, batch order and any random initialisation.", min=0)] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run in --out from its last checkpoint (same settings).")] = False,
    keep_work: Annotated[bool, typer.Option("--keep-work", help="Keep the generated replies and the training checkpoint in OUT/work after success (a few hundred MB; removed by default).")] = False,
    threads: ThreadsOpt = None,
) -> None:
    """Make a draft model for a target by distillation: the target generates replies to a prompt set
    (batched), and a small Llama-family draft sharing its tokenizer learns its next-token
    distributions. Progress bars, checkpoints every 25 steps, [bold]--resume[/bold] after an
    interruption. The result loads with --draft-model; for the default target, modes model and
    hybrid use it without one. The defaults took 13 minutes on 2 Intel Xeon cores (8 generating, 5 training) and 18 on 2 AMD EPYC cores (12 generating, 6 training)."""
    _setup(threads)
    from tandem.engine.model.loading import load_model
    from tandem.engine.model.paths import ModelError, default_draft_path
    from tandem.tools.datasets import PROMPTS_DIR
    from tandem.tools.distill import DistillConfig, dev_prompt_files
    from tandem.tools.distill import distill as run_distill

    try:
        cfg = DistillConfig(
            layers=layers, hidden=hidden, vocab_top=vocab_top, tokens=tokens, epochs=epochs, lr=lr,
            batch_size=batch_size, seed=seed, self_prompts=self_prompts,
            init_layers=tuple(int(x) for x in init_layers.split(",")) if init_layers else None,
        )
        target_lm = load_model(target)
    except (ValueError, ModelError) as exc:
        _fail(str(exc))
    data_dir = data_dir or PROMPTS_DIR
    files = list(prompts) if prompts else dev_prompt_files(data_dir)
    if not files:
        _fail(f"no prompt sets found under {data_dir}: pass --prompts FILE or --data-dir DIR")
    out = out or default_draft_path(target_lm.model_id)
    try:
        manifest = run_distill(target_lm, files, out, cfg, holdout=holdout, resume=resume, keep_work=keep_work)
    except (ValueError, FileExistsError) as exc:
        _fail(str(exc))
    agree = manifest["validation_agreement"]
    typer.echo(
        f"wrote {out}: {manifest['config']['layers']} layers, {manifest['head_rows']} head rows "
        f"({manifest['head_coverage']:.1%} of reply tokens), trained on {manifest['train_tokens']} tokens; "
        f"top-1 agreement with the target on held-out replies: "
        f"{'-' if agree is None else f'{agree:.1%}'}", err=True)


@app.command()
def loadtest(
    endpoint: Annotated[str, typer.Option("--endpoint", help="The gateway's HTTP address, HOST:PORT or http://HOST:PORT.")],
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Conversations: a bundled development set by name (mt_bench, ...), a multi-session workload (agent_tools: two-turn sessions sharing one tool list; code_twice) or any prompt file (multi-turn records run their turns in one session).")],
    concurrency: Annotated[str, typer.Option("--concurrency", "-c", help="Comma-separated concurrent session counts.")] = "1,4,16",
    turns: Annotated[int, typer.Option("--turns", help="Turns per conversation (later turns append the reply and the next user message).", min=1)] = 2,
    duration: Annotated[float, typer.Option("--duration", help="Seconds per phase after which no new request starts.", min=1)] = 120.0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="max_tokens of every request.", min=1)] = 64,
    conversations: Annotated[int, typer.Option("--conversations", help="Conversations per concurrent worker and phase.", min=1)] = 1,
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="Use the first N records.", min=1)] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the JSON report here (and a PNG plot beside it).")] = None,
    mixed: Annotated[bool, typer.Option("--mixed", help="The mixed workload instead: per concurrency, the short conversations for --duration alone, then again while long prompts (--long-tokens) arrive one after another; reports the streams' chunk gaps and TTFT during the long prefills.")] = False,
    long_tokens: Annotated[str, typer.Option("--long-tokens", help="--mixed: approximate sizes of the long prompts, in tokens, comma-separated (sent in turn).")] = "4000,7500",
    long_gap: Annotated[float, typer.Option("--long-gap", help="--mixed: seconds between one long prompt's end and the next one's start.", min=0)] = 3.0,
    strategy: Annotated[str, typer.Option("--strategy", help="The draft strategy of the phases with speculation on: ngram (prompt lookup, on the verifier), suffix, model or hybrid (these three on the stack's drafter). Not with --mixed (ngram).")] = "ngram",
    metrics: Annotated[Optional[str], typer.Option("--metrics", help="The verifiers' Prometheus endpoints (comma-separated URLs, e.g. from `tandem up --metrics`): each phase then reports what they did meanwhile: prefill tokens computed, reused, shared and recomputed after evictions, evictions, rows per step, KV occupancy.")] = None,
) -> None:
    """Load-test a running stack: concurrent multi-turn sessions, speculation off and on at each
    concurrency; aggregate tokens/s (the whole phase, and while every session had a request in
    flight: "steady"), TTFT and inter-token latency (p50, p99), acceptance and KV
    residency hit rate, plus a PNG plot of throughput and latency against concurrency. --mixed:
    whether running streams keep going while long prompts arrive (chunked prefill)."""
    _setup(1, "warning")
    from rich.console import Console

    from tandem.tools.datasets import records_for
    from tandem.tools.loadtest import plot_loadtest, run_loadtest

    console = Console(stderr=True)
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1:
            raise ValueError("--concurrency needs positive integers, e.g. 1,4,16")
        records = records_for(dataset, limit)
        if strategy not in ("ngram", "suffix", "model", "hybrid"):
            raise ValueError(f"--strategy must be ngram, suffix, model or hybrid, not {strategy!r}")
        if mixed and strategy != "ngram":
            raise ValueError("--mixed measures speculation with prompt lookup only (leave --strategy out)")
    except ValueError as exc:
        _fail(str(exc))
    base = endpoint if endpoint.startswith("http") else f"http://{endpoint}"
    if mixed:
        from tandem.tools.loadtest import run_mixed

        try:
            sizes = [int(t) for t in long_tokens.split(",") if t.strip()]
        except ValueError:
            _fail(f"--long-tokens needs integers, e.g. 4000,7500 (got {long_tokens!r})")

        def show_mixed(row: dict) -> None:
            console.print(
                f"c={row['concurrency']:<3} speculation={'on ' if row['speculation'] else 'off'} "
                f"long={'yes' if row['with_long'] else 'no '} {row['tokens_per_s']:7.1f} tok/s  "
                f"gap p50 {row['gap_p50_ms'] or 0:6.1f} p99 {row['gap_p99_ms'] or 0:7.1f} ms  "
                f"during long p99 {row['gap_during_long_p99_ms'] or 0:7.1f} ms  "
                f"TTFT p99 {row['ttft_p99_ms'] or 0:7.0f} ms (during long {row['ttft_during_long_p99_ms'] or 0:7.0f})  "
                f"long TTFT {row['long_ttft_ms']} ms ({row['errors']} + {row['long_errors']} errors)")
            if row["top_error"]:
                console.print(f"  [red]failures:[/red] {row['top_error']}")

        result = run_mixed(base, records, levels, long_tokens=sizes, long_gap_s=long_gap, turns=turns,
                           max_tokens=max_tokens, duration_s=duration, on_phase=show_mixed)
        _report(result, out, as_json=out is None)
        _fail_if_nothing_served(result)
        return

    def show(row: dict) -> None:
        console.print(
            f"c={row['concurrency']:<3} speculation={'on ' if row['speculation'] else 'off'} "
            f"{row['tokens_per_s']:7.1f} tok/s ({_steady(row)})  TTFT p50 {row['ttft_p50_ms'] or 0:7.0f} ms "
            f"p90 {row['ttft_p90_ms'] or 0:7.0f} ms  "
            f"ITL p50 {row['itl_p50_ms'] or 0:6.1f} ms p99 {row['itl_p99_ms'] or 0:6.1f} ms  "
            f"accept {row['acceptance_rate'] or 0:.0%}  residency hits {row['residency_hit_rate'] or 0:.0%}  "
            f"cached {row['cached_share'] or 0:.0%}  "
            f"({row['requests']} requests, {row['errors']} errors)"
        )
        if row["top_error"]:
            console.print(f"  [red]failures:[/red] {row['top_error']}")
        if "server" in row:
            v = row["server"]
            console.print(
                f"  server: prefill {v['prefill_computed_tokens']} computed ({v['recomputed_tokens']} after evictions, "
                f"{v['recomputed_share']:.0%}) / {v['prefill_reused_tokens']} reused ({v['prefix_shared_tokens']} shared)  "
                f"{v['evictions']} evictions  {v['rows_per_step'] or 0} rows/step over {v['steps']} steps  "
                f"KV max {v['kv_used_max_tokens']} mean {v['kv_used_mean_tokens']} of {v['kv_capacity_tokens']}  "
                f"admission queue max {v['admission_waiting_max']}")

    urls = [u.strip() for u in (metrics or "").split(",") if u.strip()]
    result = run_loadtest(base, records, levels, turns=turns, max_tokens=max_tokens, duration_s=duration,
                          conversations_per_worker=conversations, on_phase=show, strategy=strategy,
                          metrics_urls=urls or None)
    _report(result, out, as_json=out is None)
    if out:
        plot_loadtest(result, str(out.with_suffix(".png")), title=f"tandem loadtest: {Path(dataset).stem}")
        console.print(f"wrote {out.with_suffix('.png')}")
    _fail_if_nothing_served(result)


def _steady(row: dict) -> str:
    """The loadtest row's throughput while every worker had a request in flight, for its line."""
    if row.get("steady_tokens_per_s") is None:
        return "steady: no window"
    return f"steady {row['steady_tokens_per_s']:.1f} over {row['steady_window_s']:.1f} s"


def _fail_if_nothing_served(result: dict) -> None:
    """A load test whose every request in a phase failed measured nothing: say so, exit 2 (`_fail`)."""
    rows = result.get("results") or result.get("mixed") or []  # run_loadtest's or run_mixed's phases
    dead = [r for r in rows if r["requests"] and r["errors"] == r["requests"]]
    if dead:
        _fail(f"every request failed in {len(dead)} phase(s), e.g. c={dead[0]['concurrency']} "
              f"speculation={'on' if dead[0]['speculation'] else 'off'}: {dead[0]['top_error']}")


@app.command()
def certs(
    directory: Annotated[Path, typer.Argument(help="Directory to write the PEM files into (created if missing).", file_okay=False)],
    hosts: Annotated[Optional[list[str]], typer.Option("--host", help="Also make every certificate valid for this DNS name or IP address (repeatable): the address clients dial when it is not localhost, e.g. the gateway's public name.")] = None,
    days: Annotated[int, typer.Option("--days", help="Validity of the CA and the certificates, in days.", min=1)] = 365,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing CA in DIRECTORY (every certificate the old one signed stops being trusted).")] = False,
) -> None:
    """Write a development CA and a certificate per service for mutual TLS between the services.

    Files: ca.pem and ca-key.pem (the CA; its key only signs, no service needs it), and
    gateway, verifier, drafter and client certificates (ROLE.pem, ROLE-key.pem; keys mode 0600),
    each valid for the name tandem-ROLE, localhost, 127.0.0.1, ::1 and every --host. A service
    takes its own with --tls-cert, --tls-key and --tls-ca; callers check that a peer holds the
    role they expect (tandem-verifier, tandem-drafter), not its address.

    For development and tests. In production use your own CA or cert-manager, with the same
    names in the certificates; services re-read rotated files without a restart.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from tandem.serving.tls import write_dev_certs

    try:
        configs = write_dev_certs(directory, hosts=tuple(hosts or ()), days=days, overwrite=overwrite)
    except (FileExistsError, ValueError) as exc:
        _fail(str(exc))
    ca = directory / "ca.pem"
    table = Table(title=f"certificates in {escape(str(directory))}, valid {days} days")
    table.add_column("who")
    table.add_column("files")
    table.add_column("use")
    table.add_row("CA", f"{escape(str(ca))}\n{escape(str(directory / 'ca-key.pem'))}",
                  "ca.pem: every service's --tls-ca and every client's trust; ca-key.pem: keep private, signs only")
    uses = {"gateway": "tandem gateway (--tls-*; also --public-cert/--public-key for its HTTPS)", "verifier": "tandem verifier", "drafter": "tandem drafter",
            "client": "tools and tests calling the services (grpcurl, tandem bench --endpoint)"}
    for role, tls in configs.items():
        table.add_row(role, f"{escape(str(tls.cert))}\n{escape(str(tls.key))}",
                      f"{uses.get(role, role)}:\n--tls-cert {escape(str(tls.cert))} --tls-key {escape(str(tls.key))} "
                      f"--tls-ca {escape(str(ca))}")
    console = Console()
    console.print(table)
    console.print(
        "An OpenAI client trusts the gateway's HTTPS through the CA:\n"
        f"  openai.OpenAI(base_url=\"https://localhost:8000/v1\", api_key=\"-\", "
        f"http_client=httpx.Client(verify=ssl.create_default_context(cafile=\"{escape(str(ca))}\")))",
        soft_wrap=True,
    )


# -- services ----------------------------------------------------------------------------------

HostOpt = Annotated[str, typer.Option("--host", help="Interface to bind (0.0.0.0 for all).")]
RedisOpt = Annotated[
    Optional[str],
    typer.Option("--redis-url", envvar="TANDEM_REDIS_URL",
                 help="Redis URL for registration and KV residency metadata (redis://[USER:PASSWORD@]HOST:PORT/0, "
                      "rediss://... for TLS); without it the service runs standalone. Prefer the environment "
                      "variable for a URL with a password: command lines are visible to every local user."),
]
def _split_list(values: list[str] | None) -> tuple[str, ...]:
    """A repeatable option's values, each also split at commas: `--drafter a --drafter b,c` and
    TANDEM_DRAFTERS="a,b c" (an environment variable's values split at whitespace) both work."""
    return tuple(item.strip() for value in values or () for item in value.split(",") if item.strip())


def _path_str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _pem_opt(flag: str, envvar: str, help: str):
    """An optional PEM file option, which must exist."""
    return Annotated[Optional[Path], typer.Option(flag, envvar=envvar, exists=True, dir_okay=False, help=help)]


RedisCaOpt = _pem_opt("--redis-ca", "TANDEM_REDIS_CA", "CA bundle (PEM) that verifies a rediss:// server's certificate (default: the system's CAs).")
RedisCertOpt = _pem_opt("--redis-cert", "TANDEM_REDIS_CERT", "Client certificate (PEM) for a rediss:// server that requires one.")
RedisKeyOpt = _pem_opt("--redis-key", "TANDEM_REDIS_KEY", "Private key of --redis-cert, when that file does not hold it.")


TlsCertOpt = _pem_opt("--tls-cert", "TANDEM_TLS_CERT", "This service's certificate (PEM) for mutual TLS between the services (`tandem certs` makes "
                      "development ones). Needs --tls-key and --tls-ca; rotated files are picked up by new connections.")
TlsKeyOpt = _pem_opt("--tls-key", "TANDEM_TLS_KEY", "Private key of --tls-cert.")
TlsCaOpt = _pem_opt("--tls-ca", "TANDEM_TLS_CA", "CA certificate(s) that peers' certificates must chain to.")


def _drain_opt(default: float, what: str):
    return Annotated[float, typer.Option(
        "--drain-grace-s", min=0,
        help=f"At SIGTERM: stop taking new work, let {what} finish for this long, then end the rest with an "
             f"explicit error (default {default:g} s; keep it below the pod's terminationGracePeriodSeconds).")]


HealthPortOpt = Annotated[
    Optional[int],
    typer.Option("--health-port", min=0, max=65535,
                 help="Also serve gRPC health checks (only those) in plaintext on this port: probes cannot present "
                      "a client certificate to the mTLS port."),
]


@dataclass(frozen=True)
class ServiceOptions:
    """The options every service process (verifier, drafter) takes: `_service_command` adds them
    to the command and hands them over as one value."""

    threads: int | None
    log_level: str
    log_json: bool
    metrics_port: int | None
    tls_cert: Path | None
    tls_key: Path | None
    tls_ca: Path | None
    health_port: int | None
    drain_grace_s: float

    @property
    def tls(self):
        return _tls(self.tls_cert, self.tls_key, self.tls_ca)


def _service_command(drain_default: float, drain_what: str):
    """Append the options of `ServiceOptions` to a command's own (after them, in --help too) and
    call it with `svc=ServiceOptions(...)`; `drain_what` says what --drain-grace-s lets finish."""
    shared = [("threads", ThreadsOpt, None), ("log_level", LogLevelOpt, "info"), ("log_json", LogJsonOpt, False),
              ("metrics_port", MetricsPortOpt, None), ("tls_cert", TlsCertOpt, None), ("tls_key", TlsKeyOpt, None),
              ("tls_ca", TlsCaOpt, None), ("health_port", HealthPortOpt, None),
              ("drain_grace_s", _drain_opt(drain_default, drain_what), drain_default)]

    def wrap(fn):
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "svc"]
        params = own + [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind, default=default)
                        for name, kind, default in shared]

        @functools.wraps(fn)
        def command(**kwargs):
            svc = ServiceOptions(**{name: kwargs.pop(name) for name, _, _ in shared})
            return fn(svc=svc, **kwargs)

        del command.__wrapped__  # typer reads the signature below, not fn's
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def _tls(cert: Path | None, key: Path | None, ca: Path | None, *, what: str = "--tls-cert, --tls-key and --tls-ca"):
    """A TlsConfig from the three options, None when none is given; a partial set is an error."""
    given = [p for p in (cert, key, ca) if p is not None]
    if not given:
        return None
    if len(given) != 3:
        _fail(f"mutual TLS needs all of {what}")
    from tandem.serving.tlsconfig import TlsConfig

    return TlsConfig(cert=cert, key=key, ca=ca)


def _public_tls(cert: Path | None, key: Path | None):
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        _fail("HTTPS needs both --public-cert and --public-key")
    from tandem.serving.tlsconfig import TlsConfig

    return TlsConfig(cert=cert, key=key)


@app.command()
@_service_command(20.0, "running generations (the rest: UNAVAILABLE, resumed elsewhere by the gateway)")
def verifier(
    host: HostOpt = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="gRPC port (0 = any free port).", min=0, max=65535)] = 50061,
    model: ModelOpt = "default",
    redis_url: RedisOpt = None,
    redis_ca: RedisCaOpt = None,
    redis_cert: RedisCertOpt = None,
    redis_key: RedisKeyOpt = None,
    drafters: Annotated[Optional[list[str]], typer.Option(
        "--drafter", envvar="TANDEM_DRAFTERS",
        help="A drafter HOST:PORT this verifier may connect to (repeatable, or comma-separated). Requests naming "
             "any other drafter are refused with INVALID_ARGUMENT; without any, no drafter is used.")] = None,
    verifier_id: Annotated[Optional[str], typer.Option("--id", envvar="TANDEM_VERIFIER_ID", help="Stable verifier id (default: POD_NAME or host-pid).")] = None,
    advertise_address: Annotated[Optional[str], typer.Option("--advertise-address", envvar="TANDEM_ADVERTISE_ADDRESS", help="host:port that gateways reach this verifier at (default: --host:--port).")] = None,
    kv_capacity_tokens: Annotated[int, typer.Option("--kv-capacity-tokens", help="KV cache budget over all resident sessions, in tokens.", min=1)] = 65536,
    kv_memory_fraction: Annotated[Optional[float], typer.Option(
        "--kv-memory-fraction", help="Size the KV budget from memory instead: this fraction of the memory free after "
        "the model loaded (RAM, or the GPU's), capped by --kv-capacity-tokens.", min=0.01, max=0.95)] = None,
    max_sessions: Annotated[int, typer.Option(
        "--max-sessions", help="Most sessions kept resident, idle or generating (their KV within --kv-capacity-tokens); "
        "beyond, the least recently used idle session is evicted.", min=1)] = 256,
    max_generating: Annotated[int, typer.Option(
        "--max-generating", help="Most sessions generating at once (a step's rows); more requests wait in the "
        "admission queue. Idle sessions beyond it stay resident, so a conversation between its turns keeps its KV.",
        min=1)] = 64,
    admission_queue: Annotated[int, typer.Option(
        "--admission-queue", help="Requests that may wait for room when running sessions hold the KV budget or --max-generating slots "
        "(first come, first served); beyond it, RESOURCE_EXHAUSTED with a retry hint.", min=0)] = 32,
    admission_wait_s: Annotated[float, typer.Option(
        "--admission-wait-s", help="Longest wait in the admission queue before RESOURCE_EXHAUSTED.", min=0)] = 60.0,
    evict_after_idle_s: Annotated[float, typer.Option(
        "--evict-after-idle-s", help="A new session does not evict a session that ended a turn more recently than next "
        "turns usually take to come here (twice their 90th percentile), nor than this many seconds: it waits for room.",
        min=0)] = 2.0,
    prefill_chunk_tokens: Annotated[int, typer.Option(
        "--prefill-chunk-tokens", help="Chunked prefill: the most prompt tokens one step runs. Prompts run in pieces "
        "between other sessions' decoding steps, so a long prompt does not stop their streams.", min=1)] = 256,
    prefill_min_tokens: Annotated[int, typer.Option(
        "--prefill-min-tokens", help="Chunked prefill: the fewest prompt tokens a piece carries while others decode "
        "(so a long prompt always advances; at long contexts a GGUF target on a CPU may run such a piece through a "
        "share of its layers per step); set it to --prefill-chunk-tokens for whole-piece steps.", min=1)] = 4,
    prefill_cost_factor: Annotated[float, typer.Option(
        "--prefill-cost-factor", help="A step carrying prompt pieces may cost up to this many times the decoding "
        "step alone (higher: faster prefill, slower streams meanwhile).", min=1.0)] = 2.0,
    draft_wait_ms: Annotated[float, typer.Option("--draft-wait-ms", help="Longest wait for a draft block before a plain step.", min=0)] = 10.0,
    max_draft_tokens: MaxDraftOpt = 8,
    device: Annotated[str, typer.Option("--device", help="Where the target runs: auto (CUDA when a GPU is visible), cpu, cuda, cuda:N.")] = "auto",
    precision: PrecisionOpt = "auto",
    heartbeat_s: Annotated[float, typer.Option("--heartbeat-s", help="Registration heartbeat period (TTL = 5x).", min=0.1)] = 2.0,
    svc: "ServiceOptions" = None,
) -> None:
    """Run a verifier: owns the target model and the KV caches of its sessions, verifies draft
    blocks in one forward each, streams committed tokens. Publishes residency to Redis. With
    --tls-*, only callers holding a certificate from the CA are served, and drafters must present a
    drafter certificate."""
    _setup(svc.threads, svc.log_level, service="verifier", log_json=svc.log_json)
    from pydantic import ValidationError

    from tandem.services.verifier.server import serve
    from tandem.services.verifier.settings import VerifierSettings

    fields = dict(host=host, port=port, model=model, device=device, precision=precision, redis_url=redis_url, advertise_address=advertise_address,
                  kv_capacity_tokens=kv_capacity_tokens, max_sessions=max_sessions, max_generating=max_generating,
                  draft_wait_ms=draft_wait_ms,
                  kv_memory_fraction=kv_memory_fraction, admission_queue=admission_queue,
                  admission_wait_s=admission_wait_s, evict_after_idle_s=evict_after_idle_s,
                  prefill_chunk_tokens=prefill_chunk_tokens,
                  prefill_min_tokens=min(prefill_min_tokens, prefill_chunk_tokens), prefill_cost_factor=prefill_cost_factor,
                  max_draft_tokens=max_draft_tokens, heartbeat_s=heartbeat_s, threads=svc.threads,
                  metrics_port=svc.metrics_port, drafters=_split_list(drafters),
                  redis_ca=_path_str(redis_ca), redis_cert=_path_str(redis_cert), redis_key=_path_str(redis_key),
                  tls=svc.tls, health_port=svc.health_port, drain_grace_s=svc.drain_grace_s)
    if verifier_id:
        fields["verifier_id"] = verifier_id
    try:
        settings = VerifierSettings(**fields)
    except ValidationError as exc:
        _fail(f"bad verifier configuration: {exc}")
    serve(settings)


@app.command()
@_service_command(5.0, "open draft streams (their verifiers then decode plainly)")
def drafter(
    host: HostOpt = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="gRPC port (0 = any free port).", min=0, max=65535)] = 50052,
    draft_model: DraftModelOpt = None,
    drafter_id: Annotated[Optional[str], typer.Option("--id", envvar="TANDEM_DRAFTER_ID", help="Drafter id (default: POD_NAME or host-pid).")] = None,
    ngram_min: Annotated[int, typer.Option("--ngram-min", help="Shortest context suffix prompt lookup matches.", min=1, max=16)] = 1,
    ngram_max: Annotated[int, typer.Option("--ngram-max", help="Longest context suffix prompt lookup tries first.", min=1, max=16)] = 4,
    draft_top_k: Annotated[int, typer.Option("--draft-top-k", help="Support size of a sampling draft model's proposals.", min=1)] = 16,
    draft_context: Annotated[int, typer.Option("--draft-context", help="The draft model reads at most this many of a session's last tokens when it starts on it (its first look is a prefill of its own, per session; drafts only, never the output). 0: the whole context.", min=0)] = 512,
    lookahead: Annotated[bool, typer.Option("--lookahead/--no-lookahead", help="Draft the next block while the current one is verified.")] = True,
    max_sessions: Annotated[int, typer.Option("--max-sessions", help="Most open draft sessions.", min=1)] = 1024,
    draft_workers: Annotated[int, typer.Option("--draft-workers", help="Threads drafting for the sessions of all streams (a verifier sends all its sessions on one stream; each session's messages run in order, different sessions' concurrently).", min=1)] = 16,
    max_context_tokens: Annotated[int, typer.Option("--max-context-tokens", help="Longest session (context + committed tokens) drafted for; a longer one is dropped and its verifier decodes it plainly.", min=1)] = 131072,
    suffix_store_tokens: Annotated[int, typer.Option("--suffix-store-tokens", help="Suffix decoding: tokens of recent responses kept per (target model, tenant) for cross-session drafts; the oldest go first (0: none kept).", min=0)] = 100_000,
    suffix_trees: Annotated[bool, typer.Option("--suffix-trees/--no-suffix-trees", help="Suffix decoding sends token trees (several likely continuations checked in one forward) to verifiers that can verify them; off: chains only.")] = True,
    svc: "ServiceOptions" = None,
) -> None:
    """Run a drafter: hosts the proposers (prompt lookup, suffix decoding with a cross-session
    store per target model and tenant, a draft model), keeps per-session draft
    state and drafts ahead while the verifier checks the previous block. With --tls-*, only
    callers holding a certificate from the CA may open draft streams."""
    _setup(svc.threads, svc.log_level, service="drafter", log_json=svc.log_json)
    from tandem.services.drafter.server import serve
    from tandem.services.drafter.settings import DrafterSettings

    draft = None
    if draft_model:
        from tandem.engine.model.loading import load_model
        from tandem.engine.model.paths import ModelError
        from tandem.engine.native.threads import in_passing_thread

        try:
            draft = in_passing_thread(load_model, draft_model)  # no model work on the main thread
        except ModelError as exc:
            _fail(str(exc))
    fields = dict(ngram_min=ngram_min, ngram_max=ngram_max, draft_model=draft, draft_top_k=draft_top_k,
                  draft_context=draft_context or None, lookahead=lookahead, max_sessions=max_sessions, max_context_tokens=max_context_tokens,
                  draft_workers=draft_workers,
                  metrics_port=svc.metrics_port, tls=svc.tls, health_port=svc.health_port,
                  suffix_store_tokens=suffix_store_tokens, suffix_trees=suffix_trees)
    if drafter_id:
        fields["drafter_id"] = drafter_id
    try:
        settings = DrafterSettings(**fields)
    except ValueError as exc:
        _fail(str(exc))
    # Each open Draft stream holds a server thread for its life: allow many concurrent sessions.
    serve(settings, f"{host}:{port}", max_workers=max(64, 2 * max_sessions if max_sessions < 512 else 256),
          grace_s=svc.drain_grace_s)


@app.command()
def gateway(
    host: Annotated[str, typer.Option("--host", help="Interface to bind. Anything but loopback needs --api-keys (or --allow-unauthenticated).")] = "127.0.0.1",
    http_port: Annotated[int, typer.Option("--http-port", help="OpenAI-compatible HTTP port (0 = any free port).", min=0, max=65535)] = 8000,
    grpc_port: Annotated[int, typer.Option("--grpc-port", help="gRPC port of tandem.v1.Gateway (0 = any free port).", min=0, max=65535)] = 50051,
    model: Annotated[str, typer.Option("--model", "-m", help="Model whose tokenizer and chat template the gateway applies: HF directory, .gguf, or 'default'.")] = "default",
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id clients use (default: the model's own).")] = None,
    verifiers: Annotated[Optional[list[str]], typer.Option("--verifier", help="Verifier host:port (repeatable); with Redis, registered verifiers are used too.")] = None,
    drafters: Annotated[Optional[list[str]], typer.Option("--drafter", help="Drafter host:port (repeatable).")] = None,
    redis_url: RedisOpt = None,
    redis_ca: RedisCaOpt = None,
    redis_cert: RedisCertOpt = None,
    redis_key: RedisKeyOpt = None,
    max_tokens_cap: Annotated[int, typer.Option("--max-tokens-cap", help="Largest max_tokens a request may ask for.", min=1)] = 4096,
    max_concurrent_requests: Annotated[int, typer.Option("--max-concurrent-requests", help="More requests in flight are refused with 429 / RESOURCE_EXHAUSTED.", min=1)] = 256,
    log_level: LogLevelOpt = "info",
    log_json: LogJsonOpt = False,
    metrics_port: Annotated[Optional[int], typer.Option("--metrics-port", min=0, max=65535, help="Serve Prometheus metrics on this port instead of GET /metrics on the public HTTP port (0 = any free port).")] = None,
    api_keys: Annotated[Optional[Path], typer.Option("--api-keys", envvar="TANDEM_API_KEYS_FILE", help="JSON file mapping tenants to API keys and limits (docs/security.md); every /v1 route and gRPC Generate then needs 'Authorization: Bearer KEY'.")] = None,
    allow_unauthenticated: Annotated[bool, typer.Option("--allow-unauthenticated", help="Serve without API keys on a non-loopback interface (anyone who reaches it can use it).")] = False,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Largest HTTP body / gRPC message accepted (413 / RESOURCE_EXHAUSTED).", min=1024)] = 4 * 1024 * 1024,
    max_input_tokens: Annotated[Optional[int], typer.Option("--max-input-tokens", help="Largest prompt (whole session history) per request, every tenant.", min=1)] = None,
    grpc_reflection: Annotated[bool, typer.Option("--grpc-reflection/--no-grpc-reflection", help="gRPC server reflection on the public port (off: it lists the whole API to anyone).")] = False,
    speculation: SpeculationOpt = DraftStrategy.ngram,
    tool_fallback: Annotated[bool, typer.Option("--tool-fallback/--no-tool-fallback", help="Where the model's chat template has no tool support (the embedded SmolLM2's) or a call format the gateway does not parse (it knows hermes, llama3 and mistral), give requests with tools the gateway's Hermes-style <tool_call> convention (each response says tandem.tool_format: gateway/hermes), or refuse them with a clear 400.")] = True,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    public_cert: Annotated[Optional[Path], typer.Option("--public-cert", envvar="TANDEM_PUBLIC_CERT", exists=True, dir_okay=False, help="Certificate (PEM) for HTTPS and gRPC over TLS on the public ports; with --public-key.")] = None,
    public_key: Annotated[Optional[Path], typer.Option("--public-key", envvar="TANDEM_PUBLIC_KEY", exists=True, dir_okay=False, help="Private key of --public-cert.")] = None,
    drain_grace_s: _drain_opt(20.0, "requests in flight (the rest end with an SSE error event / UNAVAILABLE)") = 20.0,
    resume_wait_s: Annotated[float, typer.Option("--resume-wait-s", min=0, help="A stream cut mid-way (its verifier died or drained) with no other verifier to take it waits this long for one (a restart, a rolling update) before it ends with an error.")] = 10.0,
    routing: RoutingOpt = Routing.residency,
) -> None:
    """Run the gateway: OpenAI-compatible HTTP (/v1/chat/completions, /v1/completions, /v1/models,
    SSE streaming) and gRPC Generate; routes each session to the verifier holding its KV cache.
    With --api-keys, each key's tenant owns its sessions and caches (docs/security.md)."""
    _setup(None, log_level, service="gateway", log_json=log_json, runs_model=False)
    from pydantic import ValidationError

    from tandem.services.gateway.serve import serve
    from tandem.services.gateway.settings import GatewaySettings

    try:
        settings = GatewaySettings(
            http_host=host, grpc_host=host, http_port=http_port, grpc_port=grpc_port, model=model,
            served_model_name=served_model_name, verifiers=tuple(verifiers or ()), drafters=tuple(drafters or ()),
            redis_url=redis_url, max_tokens_cap=max_tokens_cap, max_concurrent_requests=max_concurrent_requests,
            metrics_port=metrics_port, api_keys_file=api_keys, allow_unauthenticated=allow_unauthenticated,
            max_body_bytes=max_body_bytes, max_input_tokens=max_input_tokens, grpc_reflection=grpc_reflection,
            tool_fallback=tool_fallback, shutdown_grace_s=drain_grace_s, resume_wait_s=resume_wait_s, routing=routing.value,
            default_speculation=GatewaySettings.model_fields["default_speculation"].default.model_copy(
                update={"strategy": speculation}),
            redis_ca=_path_str(redis_ca), redis_cert=_path_str(redis_cert), redis_key=_path_str(redis_key),
            tls=_tls(tls_cert, tls_key, tls_ca), public_tls=_public_tls(public_cert, public_key),
        )
    except ValidationError as exc:
        _fail(f"bad gateway configuration: {exc}")
    from tandem.services.gateway.auth import Keyring, KeyFileError

    if api_keys is not None:
        try:
            Keyring.load(api_keys)  # a bad key file is a startup error, said plainly
        except KeyFileError as exc:
            _fail(str(exc))
    serve(settings)


@app.command()
def up(
    model: ModelOpt = "default",
    draft_model: DraftModelOpt = None,
    redis_url: Annotated[Optional[str], typer.Option("--redis-url", help="Use this Redis instead of starting an embedded Valkey.")] = None,
    host: HostOpt = "127.0.0.1",
    http_port: Annotated[int, typer.Option("--http-port", help="Gateway HTTP port (OpenAI API).", min=1, max=65535)] = 8000,
    grpc_port: Annotated[int, typer.Option("--grpc-port", help="Gateway gRPC port.", min=1, max=65535)] = 50051,
    verifiers: Annotated[int, typer.Option("--verifiers", help="Verifier processes to start.", min=1, max=16)] = 1,
    verifier_threads: Annotated[Optional[int], typer.Option("--verifier-threads", help="Torch threads per verifier (default: all cores).", min=1)] = None,
    log_level: LogLevelOpt = "warning",
    tls: Annotated[bool, typer.Option("--tls", help="Mutual TLS between all services and HTTPS / gRPC TLS at the gateway, with development certificates (see --certs-dir); prints what a client needs.")] = False,
    certs_dir: Annotated[Optional[Path], typer.Option("--certs-dir", help="Where --tls keeps its development CA and certificates (made once, reused). Default: <tandem cache>/certs.", file_okay=False)] = None,
    api_keys: Annotated[Optional[Path], typer.Option("--api-keys", exists=True, dir_okay=False, help="The gateway's API key file (docs/security.md): clients must then send 'Authorization: Bearer KEY'.")] = None,
    speculation: SpeculationOpt = DraftStrategy.ngram,
    liveness_timeout_s: Annotated[float, typer.Option("--liveness-timeout-s", min=0, help="A service that has not answered a health check for this long (hung) is killed and started again; 0: only exits are watched.")] = 30.0,
    verifier_max_sessions: Annotated[Optional[int], typer.Option("--verifier-max-sessions", min=1, help="Sessions each verifier keeps resident (its --max-sessions; default: the verifier's, 256). Size it above the conversations that run at once: a full verifier evicts an idle session, which may be one between its turns.")] = None,
    verifier_kv_tokens: Annotated[Optional[int], typer.Option("--verifier-kv-capacity-tokens", min=1, help="Each verifier's KV budget in tokens (its --kv-capacity-tokens; default: the verifier's, 65,536).")] = None,
    routing: RoutingOpt = Routing.residency,
) -> None:
    """Start the whole stack on this machine: embedded Valkey (unless --redis-url; it gets a
    generated password), a drafter, verifier(s) and the gateway, as separate processes, and keep it
    up: a service that dies or hangs is started again with backoff (printed as it happens). Prints
    the endpoints; Ctrl-C stops all."""
    from tandem.tools.stack import StackConfig

    tls_dir = None
    if tls:
        from tandem.engine.native.build import cache_dir

        tls_dir = certs_dir or cache_dir() / "certs"
    _run_stack(StackConfig(model=model, draft_model=draft_model, redis_url=redis_url, host=host, http_port=http_port,
                           grpc_port=grpc_port, verifiers=verifiers, verifier_threads=verifier_threads,
                           log_level=log_level, tls_dir=tls_dir, api_keys_file=api_keys, speculation=speculation.value,
                           liveness_timeout_s=liveness_timeout_s, routing=routing.value,
                           verifier_args=(*(() if verifier_max_sessions is None else ("--max-sessions", str(verifier_max_sessions))),
                                          *(() if verifier_kv_tokens is None else ("--kv-capacity-tokens", str(verifier_kv_tokens))))),
               demo_request=False)


def _report_table(console, title: str, ok: bool, rows: list[tuple[str, str]], out: Path) -> None:
    """A soak's or check's summary as a two-column table, where its JSON went, and exit code 1 when
    it failed."""
    from rich.table import Table

    t = Table(title=f"{title} ({'ok' if ok else 'FAILED'})")
    t.add_column("")
    t.add_column("")
    for what, value in rows:
        t.add_row(what, value)
    console.print(t)
    console.print(f"report: {out}")
    if not ok:
        raise typer.Exit(1)


@app.command()
def chaos(
    model: ModelOpt = "default",
    duration: Annotated[float, typer.Option("--duration", help="Seconds of load under faults.", min=5)] = 120.0,
    sessions: Annotated[int, typer.Option("--sessions", help="Concurrent multi-turn sessions.", min=1, max=256)] = 4,
    turns: Annotated[int, typer.Option("--turns", help="Turns per conversation.", min=1)] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per turn.", min=1)] = 48,
    fault_every: Annotated[float, typer.Option("--fault-every", help="Seconds between faults (±20%, seeded).", min=1)] = 30.0,
    seed: Annotated[int, typer.Option("--seed", help="Seeds the fault schedule and the sessions' prompts.")] = 0,
    netns: Annotated[bool, typer.Option("--netns/--loopback", help="Each service in a network namespace of its own (root), or all on loopback.")] = False,
    faults: Annotated[Optional[str], typer.Option("--faults", help="Comma-separated subset of the faults (default: all): " + ", ".join(__import__("tandem.tools.chaos", fromlist=["FAULTS"]).FAULTS))] = None,
    verifier_threads: Annotated[Optional[int], typer.Option("--verifier-threads", min=1, help="Torch threads per verifier.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Where the JSON report goes.")] = Path("chaos.json"),
) -> None:
    """Soak the whole stack under a seeded fault schedule: SIGKILL / SIGTERM / SIGSTOP of services,
    a killed Valkey, link delay spikes and dropped connections, while N sessions talk to the gateway.
    Every greedy reply is checked against plain decoding; prints and writes what was completed,
    resumed, failed explicitly, truncated silently or wrong, latency calm vs under faults, restarts
    and leak checks. Exit code 1 if anything was lost, wrong or leaked."""
    _setup(None, "warning")
    from rich.console import Console

    from tandem.tools.chaos import FAULTS, ChaosConfig, run_chaos, table

    chosen = tuple(FAULTS) if faults is None else tuple(f.strip() for f in faults.split(",") if f.strip())
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        _fail(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    console = Console(stderr=True)
    cfg = ChaosConfig(model=model, duration_s=duration, sessions=sessions, turns=turns, max_tokens=max_tokens,
                      fault_every_s=fault_every, seed=seed, netns=netns, faults=chosen,
                      verifier_threads=verifier_threads)
    console.print(f"chaos: {sessions} sessions for {duration:.0f} s, a fault every ~{fault_every:.0f} s (seed {seed}), "
                  f"{'network namespaces' if netns else 'loopback'}; starting the stack ...")
    report = run_chaos(cfg, on_event=lambda text: console.print(f"  {text}", highlight=False), out=out)
    _report_table(console, "tandem chaos", report["ok"], table(report), out)


@app.command()
def determinism(
    model: ModelOpt = "default",
    draft_model: Annotated[Optional[str], typer.Option("--draft-model", help="Draft model for hybrid and model (default: the target's distilled draft, if made).")] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Rounds under load; each sends every request again.", min=1)] = 5,
    streams: Annotated[int, typer.Option("--streams", help="Concurrent greedy chat streams (one tenant, a shared system prompt).", min=1, max=64)] = 8,
    strategies: Annotated[str, typer.Option("--strategies", help="Comma-separated speculation strategies the streams rotate through.")] = ",".join(STRATEGIES_DEFAULT),
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per request.", min=1)] = 48,
    long_prompts: Annotated[int, typer.Option("--long-prompts", help="Another tenant's long prompts per round (chunked prefill beside the streams).", min=0)] = 2,
    long_words: Annotated[int, typer.Option("--long-words", help="Words of each long prompt (~1.3 tokens a word).", min=1)] = 900,
    n_choices: Annotated[int, typer.Option("--n", help="One request with this many choices per round (1: none).", min=1, max=8)] = 2,
    sampled: Annotated[bool, typer.Option("--sampled/--greedy-only", help="Seeded sampled requests too (compared with their own idle run).")] = True,
    verifiers: Annotated[int, typer.Option("--verifiers", help="Verifiers in the stack.", min=1)] = 2,
    kill_every: Annotated[int, typer.Option("--kill-every", help="SIGKILL a verifier mid-stream every k-th round (0: never).", min=0)] = 2,
    tls: Annotated[bool, typer.Option("--tls/--no-tls", help="Mutual TLS between the services, TLS at the gateway.")] = False,
    api_keys: Annotated[bool, typer.Option("--api-keys/--no-api-keys", help="Two tenants with API keys: the streams use one, the long prompts the other.")] = False,
    tools: Annotated[int, typer.Option("--tools", help="Tools listed in the streams' shared system prompt, as an agent's (40: ~700 tokens, read by every session from one copy).", min=0, max=500)] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seeds the kills and the session ids.")] = 0,
    out: Annotated[Path, typer.Option("--out", help="Where the JSON report goes.")] = Path("determinism.json"),
) -> None:
    """Check that a request gives the same token ids idle and under load: each greedy chat request
    alone first (plain decoding), then all of them at once for N rounds, rotating through the
    speculation strategies, beside another tenant's long prompts, an n > 1 request and (every k-th
    round) a verifier killed mid-stream. Prints and writes every difference; exit code 1 if any
    greedy output (or a seeded plain sampled one) differed or failed."""
    _setup(None, "warning")
    from rich.console import Console

    from tandem.tools.determinism import DeterminismConfig, find_draft, run_determinism, table

    chosen = tuple(s.strip() for s in strategies.split(",") if s.strip())
    unknown = sorted(set(chosen) - set(STRATEGIES_DEFAULT) - {"model"})
    if unknown or not chosen:
        _fail(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES_DEFAULT)}, model")
    console = Console(stderr=True)
    draft = draft_model or find_draft(model)
    if draft is None and set(chosen) & {"hybrid", "model"}:
        chosen = tuple(s for s in chosen if s not in ("hybrid", "model"))
        console.print("no draft model (pass --draft-model, or `tandem distill` makes one): hybrid and model left out")
        if not chosen:
            _fail("no strategy left to check")
    cfg = DeterminismConfig(model=model, draft_model=draft, rounds=rounds, streams=streams, strategies=chosen, max_tokens=max_tokens,
                            long_prompts=long_prompts, long_words=long_words, n_choices=n_choices, sampled=sampled, verifiers=verifiers,
                            kill_every=kill_every, tls=tls, api_keys=api_keys, tools=tools, seed=seed)
    console.print(f"determinism: {streams} streams x {rounds} rounds ({', '.join(chosen)}), {verifiers} verifiers; "
                  "starting the stack ...")
    report = run_determinism(cfg, on_event=lambda text: console.print(f"  {text}", highlight=False), out=out)
    for d in report["differences"][:10]:
        console.print(f"  differs: {d}", highlight=False)
    _report_table(console, "tandem determinism", report["ok"], table(report), out)


@app.command()
def demo(
    model: ModelOpt = "default",
    http_port: Annotated[int, typer.Option("--http-port", help="Gateway HTTP port.", min=1, max=65535)] = 8000,
    grpc_port: Annotated[int, typer.Option("--grpc-port", help="Gateway gRPC port.", min=1, max=65535)] = 50051,
    log_level: LogLevelOpt = "warning",
) -> None:
    """The main job: bring the whole stack up (as `tandem up`), send real requests through the
    gateway's OpenAI API (streamed speculative, plain for comparison, a second turn of the same
    session), show text and speculation figures, then stop everything."""
    from tandem.tools.stack import StackConfig

    _run_stack(StackConfig(model=model, http_port=http_port, grpc_port=grpc_port, log_level=log_level),
               demo_request=True)


def _grammar_option(value: str | None):
    """--response-format: None, 'json_object', or a JSON schema file."""
    if value is None:
        return None
    from tandem.contract.params import Grammar

    if value == "json_object":
        return Grammar(kind="json_object")
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--response-format is 'json_object' or a JSON schema file; {value!r} is neither")
    from tandem.engine.speculation.grammar import parse_json_schema

    return Grammar(kind="json_schema", value=parse_json_schema(path.read_text()))


def _client_hint(stack, cfg) -> str:
    """What a client of this stack needs: the CA it trusts and where its API key goes."""
    lines = []
    if stack.ca is not None:
        lines.append(f"  mTLS between the services; clients trust the CA {stack.ca}")
        lines.append(f"  curl --cacert {stack.ca} {stack.http_url}/v1/models")
    key = "YOUR_KEY" if cfg.api_keys_file is not None else "unused"
    http = (f", http_client=httpx.Client(verify=ssl.create_default_context(cafile=\"{stack.ca}\"))"
            if stack.ca is not None else "")
    lines.append(f"  openai.OpenAI(base_url=\"{stack.http_url}/v1\", api_key=\"{key}\"{http})")
    if cfg.api_keys_file is not None:
        lines.append(f"  API keys: {cfg.api_keys_file} (send 'Authorization: Bearer KEY'; gRPC: metadata authorization)")
    return "\n".join(lines)


def _run_stack(cfg, *, demo_request: bool) -> None:
    _setup(None, "info")
    from rich.console import Console

    from tandem.serving.residency import redact_url
    from tandem.tools.stack import PortTaken, Stack

    console = Console(stderr=True)
    failed = False
    if cfg.draft_model is None:
        # The target's distilled draft (`tandem distill`), when one exists, serves strategies model
        # and hybrid; without one the drafter offers prompt lookup only.
        from tandem.engine.model.paths import ModelError, find_default_draft, resolve_model_path

        try:
            found = find_default_draft(resolve_model_path(cfg.model)[0])
        except ModelError:
            found = None
        if found is not None:
            cfg.draft_model = str(found)
            console.print(f"draft model: {found} (distilled for this target; strategies model and hybrid)")
    with console.status("starting valkey, drafter, verifier(s) and gateway (first run converts the model once) ..."):
        stack = Stack(cfg)
        try:
            stack.start()
        except PortTaken as exc:
            _fail(str(exc))
        except (RuntimeError, TimeoutError) as exc:
            _fail(f"the stack did not come up: {exc}")
    try:
        console.print(
            f"[bold green]Tandem is up[/bold green]\n"
            f"  OpenAI API  {stack.http_url}/v1   (try: curl {stack.http_url}/v1/models)\n"
            f"  gRPC        {stack.grpc_address}   (tandem.v1.Gateway/Generate{'; TLS' if stack.ca else ''})\n"
            f"  verifiers   {', '.join(stack.verifier_addresses)}\n"
            f"  drafter     {stack.drafter_address}\n"
            f"  redis       {redact_url(stack.redis_url)}"
            + "".join(f"\n  metrics     {url}   ({name})" for name, url in stack.metrics_urls.items())
        )
        if stack.ca is not None or cfg.api_keys_file is not None:
            console.print(_client_hint(stack, cfg))
        if demo_request:
            from tandem.tools.demo import run_demo

            ok = run_demo(stack.http_url, console, strategy="hybrid" if cfg.draft_model else "ngram")
            if not ok:
                raise typer.Exit(1)
            return
        console.print("Ctrl-C stops everything. A service that dies is started again (printed here).")
        import signal as _signal
        import threading as _threading

        stop = _threading.Event()
        _signal.signal(_signal.SIGINT, lambda *_: stop.set())
        _signal.signal(_signal.SIGTERM, lambda *_: stop.set())
        stack.supervise(lambda text: console.print(f"[yellow]supervisor:[/yellow] {text}", highlight=False))
        while not stop.wait(1.0):
            if stack.fatal:
                console.print(f"[red]stopping the stack: {stack.fatal}[/red]", highlight=False)
                failed = True
                break
    finally:
        with console.status("stopping ..."):
            stack.stop()
        console.print("stopped")
    if failed:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
