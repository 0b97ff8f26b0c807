#!/usr/bin/env python
"""The CUDA check (issue 14): one unattended run on a machine with an NVIDIA GPU, under 8 minutes.

1. the verification kernels (Triton on the GPU) against the PyTorch reference on the CPU, on every
   case of tests/kernels (chains and trees; bit for bit is the claim, any difference is printed);
2. kernel time per call at batch 1, 8, 32 and 64 (K = 8 drafts, the default model's vocabulary), and
   a verifier step on the embedded SmolLM2 at the same batches (one ragged forward of B blocks of
   K + 1 tokens over 512 tokens of context, then the kernel): the kernel's share of a step;
3. the batched forward with the KV pool (the GPU default) against caches of their own, at the same
   batches: B rows of 1 token and of K + 1, and the largest logit difference between the two;
4. a short in-process run on the GPU: plain decoding against prompt lookup on 4 MT-Bench prompts,
   64 tokens each, greedy (outputs compared token for token);
5. the verifier's step loop (`VerifierCore`, as the gRPC server drives it, without the network) at 1
   and 16 concurrent sessions, plain decoding and prompt lookup: aggregate tokens/s, each level
   against one session (issue 14 asks 16 sessions for at least 4x one) and prompt lookup against
   plain decoding at each level (benchmarks/loop_profile.py's run, on the GPU).

    .venv/bin/python scripts/gpu_check.py [--out docs/results/gpu/gpu_check.json] [--model PATH]

Without CUDA it says so and checks what it can on the CPU (parts 2-4 on the CPU, no Triton),
so the script itself is tested where there is no GPU. Each part that fails prints its traceback
and the others still run (a lent GPU machine is held for minutes: one surprise must not cost the
rest); the report is written after every part, and the exit status says whether any failed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("tandem") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # loop_profile, the step loop benchmark this check reruns

from tandem import kernels  # noqa: E402
from tandem.kernels import reference  # noqa: E402


def _to(args: tuple, device) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@functools.cache
def _load(device, model):
    """The target, loaded once for every part that runs it (a failed load is not cached)."""
    from tandem.engine.model.loading import load_model

    return load_model(model, device=device, progress=False)


def check_kernels(device) -> dict:
    """Every test case: Triton on `device` against the reference on the CPU."""
    import test_verify_kernels as cases  # the cases of tests/kernels, not the tests

    out = {"cases": 0, "equal": 0, "different": []}
    for name, case in {**cases.CASES, **cases.TREE_CASES}.items():
        expected = getattr(reference, case.fn)(*case.args)
        got = getattr(kernels, case.fn)(*_to(case.args, device))
        same = all(torch.equal(g.cpu(), e) for g, e in zip(got, expected))
        out["cases"] += 1
        out["equal"] += same
        if not same:
            out["different"].append(name)
    return out


def _time(fn, device, repeats: int = 30) -> float:
    """Median seconds of fn() (CUDA: synchronised around each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_shares(device, model, batches=(1, 8, 32), k: int = 8, context: int = 512) -> list[dict]:
    from tandem.contract.params import SamplingParams
    from tandem.engine.scheduler.runner import TargetRunner
    from tandem.engine.speculation.draft import Draft
    from tandem.engine.speculation.sampling import make_generator
    from tandem.engine.speculation.verify import Check, verify_rows

    loaded = _load(device, model)
    runner = TargetRunner(loaded)
    vocab = loaded.vocab_size
    lo = min(100, vocab // 4)  # ordinary tokens: past the special ids at the start of a vocabulary
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        seqs = []
        for i in range(b):
            seq = runner.new_sequence()
            seq.set_context(torch.randint(lo, vocab, (context,), generator=g).tolist())
            seqs.append(seq)
        blocks = [torch.randint(lo, vocab, (k,), generator=g).tolist() for _ in range(b)]

        def forward():
            outs = runner.backend.forward_batch([(s.cache, [s.ids[-1], *d]) for s, d in zip(seqs, blocks)],
                                                [True] * b)
            for s in seqs:
                s.rollback(len(s.ids) - 1)
            return outs

        logits = torch.stack(forward())  # [B, K+1, V]
        draft_ids = torch.tensor(blocks, device=device)  # [B, K]
        num = torch.full((b,), k, device=device)  # [B]
        argmax = logits.argmax(-1)  # [B, K+1]
        probs = torch.softmax(logits, -1)  # [B, K+1, V]
        uniform = 1.0 - torch.rand(b, k, device=device)  # [B, K]
        noise = torch.empty(b, vocab, device=device).exponential_()  # [B, V]
        t_forward = _time(forward, device, 10)
        t_greedy = _time(lambda: kernels.greedy_accept(draft_ids, num, argmax), device)
        t_sampled = _time(lambda: kernels.rejection_sample(draft_ids, num, None, probs, uniform, noise), device)
        # The verifier's whole verify part of a step (verify_rows: per-row argmax / probabilities,
        # one kernel call per kind, one copy back), batched as the step loop runs it and row by
        # row as each session verifying alone would.
        row_logits = list(logits)  # B x [K+1, V] on the device
        greedy, warm = SamplingParams(max_new_tokens=k), SamplingParams(max_new_tokens=k, temperature=0.8)

        def checks(sampling):
            return [Check(Draft(d, "bench"), sampling, make_generator(i) if not sampling.greedy else None)
                    for i, d in enumerate(blocks)]

        t_rows = {name: _time(lambda s=s: verify_rows(checks(s), row_logits), device, 10)
                  for name, s in (("greedy", greedy), ("sampled", warm))}
        t_alone = {name: _time(lambda s=s: [verify_rows([c], [lg]) for c, lg in zip(checks(s), row_logits)], device, 10)
                   for name, s in (("greedy", greedy), ("sampled", warm))}
        rows.append({"batch": b, "k": k, "context": context, "forward_ms": 1e3 * t_forward,
                     "greedy_kernel_ms": 1e3 * t_greedy, "sampled_kernel_ms": 1e3 * t_sampled,
                     "greedy_share": t_greedy / (t_forward + t_greedy),
                     "sampled_share": t_sampled / (t_forward + t_sampled),
                     "verify_rows_ms": {n: 1e3 * t for n, t in t_rows.items()},
                     "verify_row_by_row_ms": {n: 1e3 * t for n, t in t_alone.items()}})
        print(f"  batch {b:>2}: forward {1e3 * t_forward:7.2f} ms, greedy kernel {1e3 * t_greedy:.3f} ms "
              f"({rows[-1]['greedy_share']:.1%}), sampled kernel {1e3 * t_sampled:.3f} ms "
              f"({rows[-1]['sampled_share']:.1%}); verify step batched greedy {1e3 * t_rows['greedy']:.2f} / "
              f"sampled {1e3 * t_rows['sampled']:.2f} ms, row by row {1e3 * t_alone['greedy']:.2f} / "
              f"{1e3 * t_alone['sampled']:.2f} ms", flush=True)
        del seqs
    return rows


def pool_vs_own(device, model, batches=(1, 8, 32), k: int = 8, context: int = 512) -> list[dict]:
    """The batched forward with every cache in the KV pool (a GPU's default: one set of KV writes
    and one attention call a layer for the whole batch) against caches of their own (per-sequence
    calls): B rows of 1 token (plain decoding of B sessions) and of K + 1 (B verification blocks),
    and the largest logit difference between the two."""
    from tandem.engine.model.llama import NativeLlama

    loaded = _load(device, model)
    # on a GPU the default (a pool); on a CPU, where the default is none, one asked for
    pool_slots = None if device.type == "cuda" else 1 << 16
    variants = {"pool": NativeLlama(loaded.model, kv_pool_slots=pool_slots),
                "own": NativeLlama(loaded.model, kv_pool_slots=0)}
    vocab = loaded.vocab_size
    lo = min(100, vocab // 4)
    g = torch.Generator().manual_seed(1)
    out = []
    for b in batches:
        contexts = [torch.randint(lo, vocab, (context,), generator=g).tolist() for _ in range(b)]
        blocks = [torch.randint(lo, vocab, (k + 1,), generator=g).tolist() for _ in range(b)]
        row = {"batch": b, "k": k, "context": context}
        logits = {}
        for name, nat in variants.items():
            caches = [nat.new_cache() for _ in range(b)]
            for ctx, cache in zip(contexts, caches):
                nat.forward_batch([(ctx, cache)], [False])

            def fwd(n: int, nat=nat, caches=caches):
                res = nat.forward_batch([(blk[:n], c) for blk, c in zip(blocks, caches)], [True] * b)
                for c in caches:
                    c.crop_to(context)
                return res

            logits[name] = torch.stack(fwd(k + 1))  # [B, K+1, V]
            row[f"{name}_1_ms"] = 1e3 * _time(lambda: fwd(1), device, 10)
            row[f"{name}_{k + 1}_ms"] = 1e3 * _time(lambda: fwd(k + 1), device, 10)
            row[f"{name}_pooled_caches"] = sum(c.pool is not None for c in caches)
            del caches
        row["max_abs_logit_diff"] = float((logits["pool"] - logits["own"]).abs().max())
        row["argmax_equal"] = float((logits["pool"].argmax(-1) == logits["own"].argmax(-1)).float().mean())
        row["plain_tokens_per_s_pool"] = b / (row["pool_1_ms"] / 1e3)
        row["plain_tokens_per_s_own"] = b / (row["own_1_ms"] / 1e3)
        out.append(row)
        print(f"  batch {b:>2}: 1-token rows pool {row['pool_1_ms']:7.2f} / own caches {row['own_1_ms']:7.2f} ms, "
              f"{k + 1}-token rows {row[f'pool_{k + 1}_ms']:7.2f} / {row[f'own_{k + 1}_ms']:7.2f} ms; "
              f"max logit diff {row['max_abs_logit_diff']:.2e}, argmax equal {row['argmax_equal']:.1%}", flush=True)
    return out


def short_bench(device, model, prompts: int = 4, max_new: int = 64) -> dict:
    from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
    from tandem.engine.model.tokenizer import apply_chat_template
    from tandem.engine.scheduler.generate import Engine
    from tandem.tools.datasets import dev_set, load_prompts

    loaded = _load(device, model)
    engine = Engine(loaded)
    records = load_prompts(dev_set("mt_bench"), prompts)
    sampling = SamplingParams(max_new_tokens=max_new)
    out = {"prompts": prompts, "max_new_tokens": max_new, "rows": []}
    for rec in records:
        ctx = apply_chat_template(loaded.tokenizer, [{"role": "user", "content": rec.turns[0]}])
        row = {}
        for mode, strategy in (("ar", DraftStrategy.none), ("ngram", DraftStrategy.ngram)):
            engine.generate(ctx, SamplingParams(max_new_tokens=4), SpecConfig(strategy=strategy))  # warm
            start = time.perf_counter()
            result = engine.generate(ctx, sampling, SpecConfig(strategy=strategy))
            row[mode] = {"seconds": time.perf_counter() - start, "tokens": result.token_ids,
                         "accepted": result.stats.accepted, "drafted": result.stats.drafted}
        row["lossless"] = row["ar"]["tokens"] == row["ngram"]["tokens"]
        row["speedup"] = row["ar"]["seconds"] / row["ngram"]["seconds"]
        out["rows"].append({k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v)
                            for k, v in row.items()})
        print(f"  {rec.id}: ngram {row['speedup']:.2f}x, lossless {row['lossless']}", flush=True)
    out["median_speedup"] = statistics.median(r["speedup"] for r in out["rows"])
    out["lossless"] = all(r["lossless"] for r in out["rows"])
    return out


def step_loop(device, model, levels=(1, 16), max_tokens: int = 64, repeat: int = 2) -> dict:
    """benchmarks/loop_profile.py's levels on `device`: c sessions at once through one VerifierCore
    (handlers are threads that only read, as the gRPC server's), each level's plain decoding and
    prompt lookup alternated `repeat` times; the best run of each is the figure (a GPU's runs
    differ by warm-up, not by neighbours), every run kept in the report. On a CPU the figures are
    not the verifier's: this process ran the other parts' forwards on its main thread, so the step
    loop's thread starts a second OpenMP pool (tandem/engine/native/threads.py); benchmarks/loop_profile.py
    measures a CPU."""
    import loop_profile  # benchmarks/

    from tandem.contract.params import DraftStrategy, SpecConfig
    from tandem.engine.model.tokenizer import apply_chat_template
    from tandem.engine.native.threads import in_passing_thread
    from tandem.services.verifier.core import VerifierCore
    from tandem.services.verifier.settings import VerifierSettings
    from tandem.tools.datasets import dev_set, load_prompts, to_chat

    loaded = _load(device, model)
    # 64k tokens hold every session of a level (16 x ~300); on a GPU the KV pool is sized from it
    settings = VerifierSettings(verifier_id="gpu-check", port=0, max_sessions=256, kv_capacity_tokens=1 << 16,
                                device=str(device))
    core = in_passing_thread(lambda: VerifierCore(settings, loaded))  # no model work on this thread
    prompts = [apply_chat_template(loaded.tokenizer, to_chat(r)) for r in load_prompts(dev_set("mt_bench"), 64)]
    specs = {"plain": SpecConfig(strategy=DraftStrategy.none), "lookup": SpecConfig(strategy=DraftStrategy.ngram)}
    try:
        loop_profile.run_level(core, prompts, 4, specs["lookup"], 16, "warm")  # kernels, cost curve
        runs = []
        for rep in range(repeat):
            for c in levels:
                for mode, spec in specs.items():
                    r = loop_profile.run_level(core, prompts, c, spec, max_tokens, f"r{rep}-{c}-{mode}")
                    runs.append({"repeat": rep, "concurrency": c, "mode": mode, **r})
                    print(f"  c={c:<3} {mode:<6} {r['tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                          f"steps {r['steps']:4d}  forward p50 (every session decoding) "
                          + (f"{r['forward_ms_full']:.2f} ms" if r["forward_ms_full"] is not None else "-"), flush=True)
    finally:
        core.stop()
    best = {(c, m): max(r["tokens_per_s"] for r in runs if r["concurrency"] == c and r["mode"] == m)
            for c in levels for m in specs}
    summary = {}
    for c in levels:
        summary[str(c)] = {
            **{f"{m}_tokens_per_s": best[c, m] for m in specs},
            **{f"{m}_vs_one_session": best[c, m] / best[levels[0], m] for m in specs},
            "lookup_vs_plain": best[c, "lookup"] / best[c, "plain"],
        }
        print(f"  {c} sessions: plain {summary[str(c)]['plain_vs_one_session']:.2f}x one session, prompt lookup "
              f"{summary[str(c)]['lookup_vs_one_session']:.2f}x; lookup vs plain {summary[str(c)]['lookup_vs_plain']:.2f}x",
              flush=True)
    return {"levels": list(levels), "max_tokens": max_tokens, "summary": summary, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/gpu/gpu_check.json")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--sessions", default="1,16", help="step loop: concurrent session counts (the first is the base)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA: Triton parts skipped)",
              "torch": torch.__version__, "python": platform.python_version(), "failed": []}
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(f"device: {report['device']}; torch {report['torch']}, python {report['python']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def part(name: str, title: str, fn) -> None:
        print(title, flush=True)
        start = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:  # noqa: BLE001 - report it and go on with the other parts
            traceback.print_exc()
            report["failed"].append(name)
            report[name] = {"error": traceback.format_exc()}
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    if cuda:
        import triton

        report["triton"] = triton.__version__

        def kernel_part() -> dict:
            k = check_kernels(device)
            print(f"  {k['equal']}/{k['cases']} cases equal to the reference; different: {k['different']}", flush=True)
            return k

        part("kernels", "kernels (Triton on the GPU against the reference on the CPU):", kernel_part)
    batches = tuple(int(b) for b in args.batches.split(","))
    part("steps", "verifier step, kernel share:", lambda: step_shares(device, args.model, batches))

    part("pool", "batched forward, KV pool against caches of their own:",
         lambda: pool_vs_own(device, args.model, batches))

    def bench_part() -> dict:
        bench = short_bench(device, args.model)
        print(f"  median {bench['median_speedup']:.2f}x, lossless {bench['lossless']}", flush=True)
        return bench

    part("bench", "in-process ar vs ngram:", bench_part)
    levels = tuple(int(c) for c in args.sessions.split(","))
    part("loop", "the step loop, concurrent sessions:", lambda: step_loop(device, args.model, levels))
    kernels_ok = not cuda or (report.get("kernels", {}).get("equal") == report.get("kernels", {}).get("cases"))
    lossless = report.get("bench", {}).get("lossless", False)
    print(f"wrote {args.out}; failed parts: {report['failed'] or 'none'}; kernels bit-exact: {kernels_ok}; "
          f"lossless: {lossless}", flush=True)
    sys.exit(0 if not report["failed"] and kernels_ok and lossless else 1)


if __name__ == "__main__":
    main()
