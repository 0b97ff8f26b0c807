"""`tandem distill`: make a small draft model for a target, by distillation on the target's own text.

Why it works on a CPU in minutes, for a target nobody made a draft for:
- The draft shares the target's tokenizer and width: its input embeddings are the target's (frozen,
  so the optimizer never touches 28 M parameters), its layers start as copies of target layers and
  its LM head as the target's head rows. Training moves a good starting point, not random weights
  (untrained, such a truncated model agrees with the target almost never; see docs/design.md).
- The head covers only the `vocab_top` ids most frequent in the training text (prompts and the
  target's replies). The full 49,152-row head is a fifth of SmolLM2-135M's cost per token; 8,192
  rows cover nearly all of what the target writes. An id outside is never proposed: verification
  stays exact, the target emits it itself.
- The training text is what the target generates (batched) for a prompt set and for prompts it
  writes itself (`write_prompts`: open-ended requests the prompt sets lack), and the loss matches
  the target's next-token distribution at every generated position (its top-K probabilities, kept
  from the generation), so the draft learns what this target says, not what some corpus says.

Phases, each resumable: write prompts and generate (teacher.pt) -> choose the head vocabulary -> train with periodic
checkpoints (checkpoint.pt) -> write a directory that `load_model` / `--draft-model` loads like any
other (config.json, model.safetensors, tokenizer, tandem_draft.json with the head's ids).

Deterministic with a seed: the generation is greedy, the data split and batch order come from
seeded generators, and a resumed run replays exactly the steps an uninterrupted run takes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.model.loading import LoadedModel
from tandem.engine.model.paths import DRAFT_MANIFEST
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.native.progress import progress_bar
from tandem.tools.datasets import DEV_SETS, PromptRecord, load_prompts, to_chat

log = logging.getLogger("tandem.tools.distill")

TEACHER_FILE = "teacher.pt"
CHECKPOINT_FILE = "checkpoint.pt"
SELF_PROMPTS_FILE = "self_prompts.jsonl"  # what the target wrote as users (kept for reading)
FORMAT = 1  # of teacher.pt and checkpoint.pt


class DistillConfig(BaseModel):
    """What `tandem distill` builds and how; the CLI is the one edge that fills it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(2, ge=1, le=64)  # transformer layers of the draft
    # Which target layers the draft's layers start from (None: the first ones: measured on
    # SmolLM2, starting from layers 0-1 reached higher agreement than from 0 and 29). Only when the
    # draft has the target's width.
    init_layers: tuple[int, ...] | None = None
    hidden: int | None = Field(None, ge=32)  # None: the target's width (embeddings and layers reused)
    vocab_top: int = Field(8192, ge=16)  # LM-head rows: the most frequent ids of the training text
    tokens: int = Field(66_000, ge=1)  # target-generated tokens to train on
    max_new_tokens: int = Field(128, ge=1)  # per prompt, as the benchmarks generate
    context_window: int = Field(256, ge=8)  # prompt tokens kept before each reply when training
    gen_batch: int = Field(32, ge=1)  # sequences the target generates at once
    teacher_top_k: int = Field(8, ge=1, le=64)  # target probabilities kept per position
    sample_temperature: float = Field(0.8, gt=0)  # replies after a file's first pass are sampled
    epochs: float = Field(5.5, gt=0)
    batch_size: int = Field(8, ge=1)
    lr: float = Field(2e-3, gt=0)
    warmup_steps: int = Field(10, ge=0)
    checkpoint_every: int = Field(25, ge=1)
    validation_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    # User messages the target writes for itself, one more source of training prompts (0: none).
    # Why: the prompt files hold few open-ended requests (writing, role play, advice), and a draft
    # that never saw the target's prose agrees with it on prose a fifth of the time.
    self_prompts: int = Field(128, ge=0)
    self_prompt_tokens: int = Field(96, ge=8)  # longest self-written user message
    self_prompt_temperature: float = Field(0.8, gt=0)  # 1.0 wrote more garbled requests
    seed: int = 0


# --- training prompts -------------------------------------------------------------------------------


def dev_prompt_files(data_dir: Path) -> list[Path]:
    """The shared prompt sets to train on by default: the four dev sets (their first prompts held
    out, see `training_records`)."""
    files = [data_dir / rel for _, rel in DEV_SETS]
    return [f for f in files if f.exists()]


def benchmarked(path: Path) -> bool:
    return any(path.name == Path(rel).name for _, rel in DEV_SETS)


def training_records(files: list[Path], holdout: int) -> list[list[PromptRecord]]:
    """Records of each file; the first `holdout` of each benchmarked dev set are left out, because
    the benchmarks run exactly those (`--limit 20` reads the first 20): a draft trained on the
    target's answers to the benchmark's own prompts would measure memory, not drafting."""
    out: list[list[PromptRecord]] = []
    for f in files:
        records = load_prompts(f)
        skip = holdout if benchmarked(f) else 0
        out.append(records[skip:])
        log.info("training prompts: %s: %d (first %d held out)", f.name, max(0, len(records) - skip), skip)
    return [r for r in out if r]


def prompt_stream(per_file: list[list[list[int]]], seed: int):
    """(prompt ids, pass) forever: round-robin over the files, so every kind of text (tool calls,
    code, math, prose) gets an equal share of the token budget however many prompts a file has. A
    file's prompts come in a seeded order per pass; a small file starts its next pass sooner, and
    passes after the first are sampled (different replies to the same prompts, each position still
    labelled with the target's exact distribution)."""
    cursors = [0] * len(per_file)
    passes = [0] * len(per_file)
    orders = [torch.randperm(len(p), generator=torch.Generator().manual_seed(seed * 7919 + i)).tolist()
              for i, p in enumerate(per_file)]
    while True:
        for i, prompts in enumerate(per_file):
            if cursors[i] == len(prompts):
                cursors[i], passes[i] = 0, passes[i] + 1
                g = torch.Generator().manual_seed(seed * 7919 + i + 1000 * passes[i])
                orders[i] = torch.randperm(len(prompts), generator=g).tolist()
            yield prompts[orders[i][cursors[i]]], passes[i]
            cursors[i] += 1


@torch.inference_mode()
def write_prompts(target: LoadedModel, cfg: DistillConfig, *, progress: bool = True) -> list[str]:
    """`cfg.self_prompts` user messages sampled from the target itself: its chat template opened
    at a user turn, continued at `self_prompt_temperature` until the turn ends (or
    `self_prompt_tokens`), `gen_batch` at a time. An instruction-tuned target has seen many users:
    what it writes there is a spread of requests (advice, stories, code, e-mails) in the proportions
    of its own training, needing no dataset at all. Deterministic with the seed."""
    from tandem.engine.model.llama import NativeLlama

    if cfg.self_prompts == 0:
        return []
    tok = target.tokenizer
    if getattr(tok, "chat_template", None) is None:  # the plain transcript apply_chat_template falls back to
        head, tail = "user: ", "\n"
    else:
        marker = "\u2063TANDEM\u2063"
        rendered = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
        head, tail = rendered.split(marker, 1)
    prefix = tok(head, add_special_tokens=False)["input_ids"]
    tail_ids = tok(tail, add_special_tokens=False)["input_ids"]
    stop = set(target.eos_token_ids) | set(tail_ids[:1])  # the token that closes a user turn
    native = NativeLlama(target.model)
    texts: list[str] = []
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("target writing its own prompts", total=cfg.self_prompts)
        for lo in range(0, cfg.self_prompts, cfg.gen_batch):
            group = []
            for i in range(lo, min(cfg.self_prompts, lo + cfg.gen_batch)):
                cache = native.new_cache(len(prefix) + cfg.self_prompt_tokens + 1)
                native.forward(prefix[:-1], cache, all_logits=False)
                group.append({"ids": [prefix[-1]], "cache": cache, "open": True,
                              "gen": torch.Generator().manual_seed(cfg.seed * 1_000_003 + 500_000 + i)})
            for _ in range(cfg.self_prompt_tokens):
                live = [s for s in group if s["open"]]
                if not live:
                    break
                logits = native.forward_batch([([s["ids"][-1]], s["cache"]) for s in live])  # each [1, vocab]
                for s, lg in zip(live, logits):
                    probs = torch.softmax(lg[0].float() / cfg.self_prompt_temperature, -1)  # [vocab]
                    nxt = int(torch.multinomial(probs, 1, generator=s["gen"]))
                    if nxt in stop:
                        s["open"] = False
                    else:
                        s["ids"].append(nxt)
            # one cut at the length limit is still a request; an empty one is dropped
            texts.extend(t for t in (tok.decode(s["ids"][1:]).strip() for s in group) if t)
            bar.advance(task, len(group))
    return texts


# --- phase 1: the target generates, and its distributions are kept -------------------------------------


@dataclass
class TeacherSeq:
    ids: list[int]  # prompt (chat template applied) followed by the target's reply
    start: int  # len(prompt): targets are the distributions that produced ids[start:]
    top_ids: torch.Tensor  # [len(ids) - start, K] int32: the target's most likely next ids
    top_probs: torch.Tensor  # [len(ids) - start, K] float16: their probabilities


@torch.inference_mode()
def generate_teacher(target: LoadedModel, prompts, cfg: DistillConfig, *, progress: bool = True) -> list[TeacherSeq]:
    """Replies of the target to `prompts` (an iterator of (ids, pass): greedy on pass 0, sampled
    after) until `cfg.tokens` reply tokens exist, `gen_batch` sequences at a time in one batched
    forward (continuous: a finished sequence's slot takes the next prompt). Every position keeps
    the target's top-K next-token probabilities (temperature 1: the target's own distribution)."""
    from tandem.engine.model.llama import NativeLlama

    native = NativeLlama(target.model)
    eos = set(target.eos_token_ids)
    out: list[TeacherSeq] = []
    total = 0
    started = 0
    prompts = iter(prompts)
    live: list[dict] = []
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("target generating training text (tokens)", total=cfg.tokens)
        while total < cfg.tokens:
            # fill free slots, but start no more replies than the budget can still use
            while len(live) < cfg.gen_batch and total + len(live) * cfg.max_new_tokens // 2 < cfg.tokens:
                item = next(prompts, None)
                if item is None:
                    break
                ids, npass = item
                if len(ids) + cfg.max_new_tokens >= target.max_context:
                    continue
                cache = native.new_cache(len(ids) + cfg.max_new_tokens + 1)
                if len(ids) > 1:
                    native.forward(ids[:-1], cache, all_logits=False)
                gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + started) if npass else None
                started += 1
                live.append({"ids": list(ids), "start": len(ids), "cache": cache, "top_ids": [], "top_probs": [],
                             "gen": gen})
            if not live:
                break
            logits = torch.cat(native.forward_batch([([s["ids"][-1]], s["cache"]) for s in live]))  # [B, vocab]
            # one softmax and top-k for the whole batch (the forward dominates either way: 469 s for 66k tokens)
            top = torch.topk(torch.softmax(logits, -1), cfg.teacher_top_k)  # [B, K] each
            top_ids, top_probs = top.indices.to(torch.int32), top.values.to(torch.float16)
            sampled = [b for b, s in enumerate(live) if s["gen"] is not None]
            tempered = torch.softmax(logits[sampled] / cfg.sample_temperature, -1) if sampled else None  # [S, vocab]
            done = []
            for b, s in enumerate(live):
                s["top_ids"].append(top_ids[b])
                s["top_probs"].append(top_probs[b])
                if s["gen"] is None:
                    tok = int(top_ids[b, 0])
                else:
                    tok = int(torch.multinomial(tempered[sampled.index(b)], 1, generator=s["gen"]))
                s["ids"].append(tok)
                total += 1
                bar.advance(task)
                if tok in eos or len(s["ids"]) - s["start"] >= cfg.max_new_tokens:
                    done.append(s)
            for s in done:
                live.remove(s)
                out.append(_finish(s))
        for s in live:  # the budget ran out mid-reply: keep what exists
            out.append(_finish(s))
    return out


def _finish(s: dict) -> TeacherSeq:
    return TeacherSeq(ids=s["ids"], start=s["start"], top_ids=torch.stack(s["top_ids"]),
                      top_probs=torch.stack(s["top_probs"]))


# --- phase 2: the head's vocabulary --------------------------------------------------------------------


def choose_head_vocab(seqs: list[TeacherSeq], n: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The n ids most frequent in the training text (replies and prompts alike: replies copy from
    prompts), `always` (end-of-sequence ids) included; sorted, `# [n]` int64. Ties break by id."""
    counts: Counter[int] = Counter()
    for s in seqs:
        counts.update(s.ids)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    chosen = list(dict.fromkeys([t for t in always if t < vocab_size] + ranked))[:n]
    if len(chosen) < n:  # a small training set: fill with the lowest unused ids, deterministically
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][: n - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(seqs: list[TeacherSeq], head_vocab: torch.Tensor) -> float:
    """Fraction of reply tokens the head can propose."""
    keep = set(head_vocab.tolist())
    replies = [t for s in seqs for t in s.ids[s.start:]]
    return sum(t in keep for t in replies) / len(replies) if replies else 0.0


# --- phase 3: the draft model --------------------------------------------------------------------------


def spread_layers(n_target: int, n_draft: int) -> tuple[int, ...]:
    """n_draft target layers spread evenly, first and last included (one layer: the first); an
    alternative starting point (`--init-layers`)."""
    if n_draft == 1:
        return (0,)
    return tuple(round(i * (n_target - 1) / (n_draft - 1)) for i in range(n_draft))


def build_draft(target: LoadedModel, head_vocab: torch.Tensor, cfg: DistillConfig) -> torch.nn.Module:
    """A Llama-family draft whose head has one row per id of `head_vocab`, initialised from the
    target (same width) or from a projection of its embeddings (narrower)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.engine.model.llama import rope_theta

    tcfg = target.model.config
    t_hidden = tcfg.hidden_size
    hidden = cfg.hidden or t_hidden
    same_width = hidden == t_hidden
    if same_width:
        heads, kv_heads, inter = tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.intermediate_size
        head_dim = getattr(tcfg, "head_dim", None) or t_hidden // heads
    else:
        head_dim = 64 if hidden >= 64 else hidden
        heads = max(1, hidden // head_dim)
        kv_heads = heads
        inter = int(round(hidden * tcfg.intermediate_size / t_hidden / 32)) * 32 or 32
    config = LlamaConfig(
        vocab_size=tcfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=cfg.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=tcfg.max_position_embeddings,
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=rope_theta(tcfg),
        tie_word_embeddings=False,
        bos_token_id=getattr(tcfg, "bos_token_id", None),
        eos_token_id=getattr(tcfg, "eos_token_id", None),
        pad_token_id=getattr(tcfg, "pad_token_id", None),
    )
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(config)
    t_base = target.model.model
    t_head = target.model.get_output_embeddings().weight.detach()  # [vocab, t_hidden]
    with torch.no_grad():
        if same_width:
            draft.model.embed_tokens.weight.copy_(t_base.embed_tokens.weight)
            chosen = cfg.init_layers or tuple(range(cfg.layers))
            if len(chosen) != cfg.layers or max(chosen) >= tcfg.num_hidden_layers:
                raise ValueError(f"init layers {chosen} do not name {cfg.layers} of the target's "
                                 f"{tcfg.num_hidden_layers} layers")
            for dst, src in zip(draft.model.layers, chosen):
                dst.load_state_dict(t_base.layers[src].state_dict())
            draft.model.norm.weight.copy_(t_base.norm.weight)
            head = t_head[head_vocab]  # [rows, hidden]
        else:
            # The target's embeddings projected on their top principal directions keep most of
            # what distinguishes tokens; layers start random.
            emb = t_base.embed_tokens.weight.detach().float()  # [vocab, t_hidden]
            _, _, v = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)  # v: [t_hidden, t_hidden]
            proj = v[:hidden].T  # [t_hidden, hidden]
            draft.model.embed_tokens.weight.copy_(emb @ proj)
            head = (t_head.float() @ proj)[head_vocab]  # [rows, hidden]
        draft.lm_head = torch.nn.Linear(hidden, len(head_vocab), bias=False)
        draft.lm_head.weight.copy_(head)
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


# --- phase 4: training ----------------------------------------------------------------------------------


@dataclass
class Example:
    ids: torch.Tensor  # [T] int64: context window + reply
    first: int  # position whose output is the first target
    targets: torch.Tensor  # [n, K] int64 head rows of the teacher's top ids (-1: not in the head)
    weights: torch.Tensor  # [n, K] float32 teacher probabilities, renormalised over in-head rows


def make_examples(seqs: list[TeacherSeq], head_vocab: torch.Tensor, vocab_size: int, window: int) -> list[Example]:
    row_of = torch.full((vocab_size,), -1, dtype=torch.long)
    row_of[head_vocab] = torch.arange(len(head_vocab))
    out = []
    for s in seqs:
        n = len(s.ids) - s.start
        if n <= 0:
            continue
        lo = max(0, s.start - window)
        ids = torch.tensor(s.ids[lo:], dtype=torch.long)
        rows = row_of[s.top_ids.long()]  # [n, K]
        w = s.top_probs.float() * (rows >= 0)
        mass = w.sum(-1, keepdim=True)
        keep = mass[:, 0] > 0
        w = torch.where(mass > 0, w / mass.clamp_min(1e-12), w)
        if not bool(keep.any()):
            continue
        # the distribution producing ids[start + j] is the output at position start - 1 + j
        out.append(Example(ids=ids, first=s.start - 1 - lo, targets=rows.clamp_min(0), weights=w))
    return out


def _batch(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `ids [B, T]`, `mask [B, T]`, and the flattened target positions
    `pos [M]` (into B*T), `targets [M, K]`, `weights [M, K]`."""
    T = max(len(e.ids) for e in examples)
    ids = torch.zeros(len(examples), T, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.long)
    pos, tg, wt = [], [], []
    for b, e in enumerate(examples):
        ids[b, : len(e.ids)] = e.ids
        mask[b, : len(e.ids)] = 1
        n = e.targets.shape[0]
        pos.append(b * T + e.first + torch.arange(n))
        tg.append(e.targets)
        wt.append(e.weights)
    return ids, mask, torch.cat(pos), torch.cat(tg), torch.cat(wt)


def batch_loss(draft: torch.nn.Module, examples: list[Example]) -> tuple[torch.Tensor, int, int]:
    """Soft cross-entropy against the teacher's top-K (in-head) probabilities at the reply positions;
    also (top-1 agreements, positions) for the agreement figure."""
    ids, mask, pos, targets, weights = _batch(examples)
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    h = hidden.reshape(-1, hidden.shape[-1])[pos]  # [M, H]
    logp = F.log_softmax(draft.lm_head(h).float(), -1)  # [M, rows]
    loss = -(weights * logp.gather(1, targets)).sum(-1).mean()
    agree = int((logp.argmax(-1) == targets[:, 0]).logical_and(weights[:, 0] > 0).sum())
    return loss, agree, int(pos.numel())


@torch.no_grad()
def agreement(draft: torch.nn.Module, examples: list[Example], batch_size: int) -> float:
    """Top-1 agreement with the target on `examples`: the draft's greedy acceptance, per position."""
    draft.eval()
    agree = total = 0
    for i in range(0, len(examples), batch_size):
        _, a, n = batch_loss(draft, examples[i : i + batch_size])
        agree, total = agree + a, total + n
    draft.train()
    return agree / total if total else 0.0


def _lr(step: int, total: int, cfg: DistillConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def schedule(n_examples: int, cfg: DistillConfig) -> list[list[int]]:
    """Every step's example indices, fixed by the seed: epoch e shuffles with seed + e."""
    steps_per_epoch = math.ceil(n_examples / cfg.batch_size)
    total = max(1, round(cfg.epochs * steps_per_epoch))
    out: list[list[int]] = []
    epoch = 0
    while len(out) < total:
        g = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
        order = torch.randperm(n_examples, generator=g).tolist()
        out.extend(order[i : i + cfg.batch_size] for i in range(0, n_examples, cfg.batch_size))
        epoch += 1
    return out[:total]


def train(draft: torch.nn.Module, train_set: list[Example], cfg: DistillConfig, workdir: Path, *,
          resume: bool, progress: bool = True, stop_after: int | None = None) -> dict:
    """Train `draft` in place; checkpoint every `cfg.checkpoint_every` steps into workdir.
    `stop_after` ends the run after that many steps (as an interruption would; tests use it)."""
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    plan = schedule(len(train_set), cfg)
    step = 0
    ckpt = workdir / CHECKPOINT_FILE
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state.get("format") != FORMAT or state.get("config") != cfg.model_dump():
            raise ValueError(f"{ckpt} was written with other settings; remove it to start over")
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        log.info("resumed from %s at step %d of %d", ckpt, step, len(plan))
    draft.train()
    losses: list[float] = []
    started = time.perf_counter()
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("training the draft (steps)", total=len(plan), completed=step)
        while step < len(plan):
            if stop_after is not None and step >= stop_after:
                break
            for group in opt.param_groups:
                group["lr"] = _lr(step, len(plan), cfg)
            loss, _, _ = batch_loss(draft, [train_set[i] for i in plan[step]])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
            bar.advance(task)
            if step % cfg.checkpoint_every == 0 or step == len(plan):
                _save_checkpoint(ckpt, draft, opt, step, cfg)
                log.info("step %d/%d: loss %.3f (mean of the last %d)", step, len(plan),
                         sum(losses[-cfg.checkpoint_every:]) / len(losses[-cfg.checkpoint_every:]),
                         len(losses[-cfg.checkpoint_every:]))
    return {"steps": step, "total_steps": len(plan), "seconds": time.perf_counter() - started,
            "final_loss": losses[-1] if losses else None}


def _save_checkpoint(path: Path, draft: torch.nn.Module, opt, step: int, cfg: DistillConfig) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save({"format": FORMAT, "config": cfg.model_dump(), "step": step,
                "model": draft.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)  # atomic: an interruption never leaves half a checkpoint


# --- phase 5: the draft directory -----------------------------------------------------------------------


def save_draft(draft: torch.nn.Module, target: LoadedModel, head_vocab: torch.Tensor, out: Path, manifest: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(str(out))
    state = {k: v.detach().contiguous() for k, v in draft.state_dict().items() if "rotary" not in k}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    target.tokenizer.save_pretrained(str(out))
    gen = getattr(target.model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(out))
    (out / DRAFT_MANIFEST).write_text(json.dumps({**manifest, "head_vocab": head_vocab.tolist()}) + "\n")


# --- the whole job ----------------------------------------------------------------------------------


def distill(target: LoadedModel, prompt_files: list[Path], out: Path, cfg: DistillConfig, *, holdout: int = 20,
            resume: bool = False, progress: bool = True, stop_after: int | None = None,
            keep_work: bool = False) -> dict:
    """Run every phase (reusing what `out` already holds when resuming); returns the manifest.

    After a complete run the large work files (the generated replies and the training checkpoint,
    a few hundred MB for the default target) are removed unless `keep_work`; the small ones (the
    config, the prompts the target wrote) stay in `out/work` for reading."""
    work = out / "work"
    if work.exists() and not resume:
        raise FileExistsError(f"{out} holds an earlier run: pass --resume to continue it, or remove {out}")
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
    torch.manual_seed(cfg.seed)

    teacher_path = work / TEACHER_FILE
    if teacher_path.exists():
        saved = torch.load(teacher_path, weights_only=False)
        seqs = [TeacherSeq(**s) for s in saved["seqs"]]
        log.info("reusing %d generated sequences from %s", len(seqs), teacher_path)
    else:
        per_file = training_records(prompt_files, holdout)
        if not per_file and cfg.self_prompts == 0:
            raise ValueError("no training prompts: give --prompts files or a --data-dir with the dev sets")
        prompts = [[apply_chat_template(target.tokenizer, to_chat(r, 0)) for r in recs] for recs in per_file]
        started = time.perf_counter()
        own = write_prompts(target, cfg, progress=progress)
        if own:
            (work / SELF_PROMPTS_FILE).write_text("".join(json.dumps({"prompt": t}) + "\n" for t in own))
            log.info("the target wrote %d prompts of its own in %.0f s (%s), e.g. %r", len(own),
                     time.perf_counter() - started, work / SELF_PROMPTS_FILE, own[0][:120])
            prompts.append([apply_chat_template(target.tokenizer, [{"role": "user", "content": t}]) for t in own])
        seqs = generate_teacher(target, prompt_stream(prompts, cfg.seed), cfg, progress=progress)
        log.info("generated %d tokens in %.0f s", sum(len(s.ids) - s.start for s in seqs), time.perf_counter() - started)
        tmp = teacher_path.with_name(TEACHER_FILE + ".partial")
        torch.save({"format": FORMAT, "seqs": [s.__dict__ for s in seqs]}, tmp)
        os.replace(tmp, teacher_path)

    vocab_size = int(target.model.config.vocab_size)
    head_vocab = choose_head_vocab(seqs, min(cfg.vocab_top, vocab_size), vocab_size, target.eos_token_ids)
    cover = coverage(seqs, head_vocab)
    log.info("head vocabulary: %d ids cover %.1f%% of the reply tokens", len(head_vocab), 100 * cover)

    examples = make_examples(seqs, head_vocab, vocab_size, cfg.context_window)
    n_val = int(round(len(examples) * cfg.validation_fraction))
    split = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed + 1)).tolist()
    val_set = [examples[i] for i in split[:n_val]]
    train_set = [examples[i] for i in split[n_val:]]

    draft = build_draft(target, head_vocab, cfg)
    before = agreement(draft, val_set, cfg.batch_size) if val_set else None
    stats = train(draft, train_set, cfg, work, resume=resume, progress=progress, stop_after=stop_after)
    after = agreement(draft, val_set, cfg.batch_size) if val_set else None
    if before is not None:
        log.info("top-1 agreement with the target on %d held-out replies: %.1f%% before training, %.1f%% after",
                 len(val_set), 100 * before, 100 * after)
    manifest = {
        "target": target.model_id,
        "target_path": target.path,
        "config": cfg.model_dump(),
        "holdout_per_dev_set": holdout,
        "prompt_files": [str(p) for p in prompt_files],
        "self_prompts": cfg.self_prompts,
        "train_tokens": sum(len(s.ids) - s.start for s in seqs),
        "sequences": len(seqs),
        "head_rows": len(head_vocab),
        "head_coverage": cover,
        "validation_agreement_before": before,
        "validation_agreement": after,
        "training": stats,
        "complete": stats["steps"] == stats["total_steps"],
    }
    if manifest["complete"]:
        save_draft(draft, target, head_vocab, out, manifest)
        if not keep_work:
            for name in (TEACHER_FILE, CHECKPOINT_FILE):
                (work / name).unlink(missing_ok=True)
    return manifest

