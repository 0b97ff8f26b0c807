"""A model's tokenizer and chat template, without its weights and without torch.

The gateway only tokenizes, so it loads the tokenizer class that the model's tokenizer_config.json
names directly from `transformers` (those classes wrap the `tokenizers` library and import no
torch; `AutoTokenizer` and `AutoConfig` do) and reads the context window from config.json. The
verifier loads the same files through `load_model`, so both tiers give a text the same ids
(tests/engine/test_tokenizer.py compares them). A GGUF file is converted once, as `load_model`
does, in a child process: the conversion needs torch, the gateway process never imports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tandem.engine.model.paths import DEFAULT_MODEL, ModelError, converted, gguf_cache_for, resolve_model_path


def apply_chat_template(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat, rendered by the tokenizer's own template."""
    if getattr(tokenizer, "chat_template", None) is None:
        # No template: a plain transcript is the honest fallback, and it stays deterministic.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(out, "keys"):  # transformers >= 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def tokenizer_class(path: Path):
    """The tokenizer class a model directory names (tokenizer_config.json's `tokenizer_class`), the
    generic fast tokenizer where it names none or one transformers does not have."""
    import transformers

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class") or ""
    except (OSError, ValueError):
        name = ""
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else transformers.PreTrainedTokenizerFast


def _convert_elsewhere(gguf: Path, progress: bool) -> Path:
    """`load_model`'s one-time GGUF conversion, run in a child process (it needs torch)."""
    out = gguf_cache_for(gguf)
    if converted(out):
        return out
    code = ("import sys; from pathlib import Path; from tandem.engine.model.loading import convert_gguf; "
            "print(convert_gguf(Path(sys.argv[1]), progress=sys.argv[2] == '1'))")
    res = subprocess.run([sys.executable, "-c", code, str(gguf), "1" if progress else "0"],
                         stdout=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise ModelError(f"converting {gguf} failed (exit {res.returncode}; its error is above)")
    return Path(res.stdout.strip().splitlines()[-1])


def load_tokenizer(name_or_path: str | None = DEFAULT_MODEL, *, progress: bool = True) -> tuple[str, object, int]:
    """(model_id, tokenizer, max_context) of a model without loading its weights, for services that
    only tokenize (the gateway). Ids and context window follow `load_model`'s rules, so a gateway and
    a verifier given the same value agree on both."""
    model_id, path = resolve_model_path(name_or_path)
    if path.suffix == ".gguf":
        path = _convert_elsewhere(path, progress)
    try:
        tokenizer = tokenizer_class(path).from_pretrained(str(path))
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a tokenizer from {path}: {exc}") from exc
    return model_id, tokenizer, int(config.get("max_position_embeddings") or 2048)
