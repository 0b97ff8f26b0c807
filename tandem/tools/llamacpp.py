"""llama.cpp as a benchmark peer (`tandem bench --modes ar,hybrid,llamacpp,llamacpp-lookup`).

On a CPU, people run a GGUF file with llama.cpp; a user deciding between the two wants both on the
same file, prompts, host and threads, in one sitting. This runs llama.cpp in process through its
Python binding (llama-cpp-python, the optional `peers` extra: `pip install 'tandem[peers]'`, which
compiles llama.cpp for the host's CPU) on the token ids our modes get, so both start from the same
prompt, and times a call as ours are timed (wall time, prefill included, the KV cache emptied first).

Modes: `llamacpp` (plain decoding, the baseline of llama.cpp's family) and `llamacpp-lookup`
(llama.cpp's prompt-lookup decoding, `LlamaPromptLookupDecoding`). Greedy output is llama.cpp's
own: its kernels round differently from ours, so it need not equal Tandem's token for token; the
report's `agreement_with_ar` says on what share of prompts it does.
"""

from __future__ import annotations

import time

import torch

from tandem.contract.params import SamplingParams
from tandem.contract.results import FinishReason
from tandem.contract.results import GenerationResult

LOOKUP_TOKENS = 10  # LlamaPromptLookupDecoding's default num_pred_tokens


class PeerUnavailable(ValueError):
    """llama.cpp cannot run here (binding not installed, or no GGUF file); the message says why."""


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppPeer:
    """llama.cpp over a GGUF file for both llama.cpp modes: a context for plain decoding and one
    with its prompt-lookup drafter."""

    def __init__(self, gguf_file: str | None, *, n_ctx: int, threads: int | None = None,
                 lookup_tokens: int = LOOKUP_TOKENS):
        if gguf_file is None:
            raise PeerUnavailable("the llama.cpp modes run a GGUF file: give --model a .gguf file (or 'default')")
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:
            raise PeerUnavailable(
                "the llama.cpp modes need llama-cpp-python: pip install 'tandem[peers]' (compiles llama.cpp, "
                f"several minutes on 2 cores): {exc}") from exc
        self.threads = threads or torch.get_num_threads()
        common = dict(model_path=gguf_file, n_ctx=n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                      verbose=False)
        # Two contexts: prompt lookup needs the logits of every position (the binding turns that on
        # when a draft model is given at construction), which would make plain decoding's prefill
        # run the LM head over the whole prompt.
        self.plain = Llama(**common)
        # logits_all too: the binding (0.3.36) sizes its logits buffer from the argument, not from the
        # draft model, and a prompt past n_batch (512) tokens then fails to fit
        self.lookup = Llama(**common, logits_all=True, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens))
        self.lookup_tokens = lookup_tokens
        self.version = __import__("llama_cpp").__version__

    def generate(self, ids: list[int], sampling: SamplingParams, stop: set[int], mode: str,
                 max_new_tokens: int) -> GenerationResult:
        """One generation of up to `max_new_tokens` after `ids`, cut at the first id of `stop` (not
        output), as ours are."""
        llm = self.lookup if mode == "llamacpp-lookup" else self.plain
        if sampling.greedy:
            params = dict(temp=0.0, top_k=1, top_p=1.0)
        else:
            params = dict(temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)
            llm.set_seed(sampling.seed if sampling.seed is not None else 0)
        tokens: list[int] = []
        stopped = False
        start = time.perf_counter()
        llm.reset()  # no KV reuse from the previous call: each call pays its prefill, as ours do
        for tok in llm.generate(ids, reset=True, repeat_penalty=1.0, min_p=0.0, **params):
            if tok in stop:
                stopped = True
                break
            tokens.append(int(tok))
            if len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return GenerationResult(
            token_ids=tokens,
            finish_reason=FinishReason.stop if stopped else FinishReason.length,
            stats=None,
            prompt_tokens=len(ids),
            seconds=seconds,
            first_token_seconds=seconds,  # not observed separately
        )
