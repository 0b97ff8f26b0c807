"""The target runner: a KV cache per sequence, one forward over a block of new tokens, rollback.

Invariant of a `Sequence` between steps: `ids` are the committed tokens (prompt + output so far) and
the KV cache holds exactly `ids[:-1]`. The last committed token is *pending*: the next step feeds it
together with the k drafts, so one forward yields the k+1 distributions that verification needs:

    input  = [ids[-1], d_0, ..., d_{k-1}]          # k+1 tokens
    logits = [k+1, vocab]; row i predicts the token after input i
    accept a drafts, commit a+1 tokens (accepted drafts + recovered/bonus), crop the cache to the
    new len(ids) - 1, which drops the KV of rejected drafts.

Worked example: ids = [5, 9] (cache holds [5]); drafts [7, 3]; forward [9, 7, 3] (cache now [5, 9, 7,
3]); target argmax rows = [7, 4, ...] so a = 1 and 4 is the recovered token; ids = [5, 9, 7, 4] and
the cache is cropped to 3 entries [5, 9, 7]. The pending token is 4.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import logging

import torch

from tandem.contract.ids import common_prefix_len
from tandem.engine.model.backends import ForwardCosts, NominalCosts, make_backend
from tandem.engine.model.loading import LoadedModel
from tandem.engine.scheduler.batching import SHARE_MIN_TOKENS, BatchExecutor
from tandem.engine.scheduler.prefill import PrefillPolicy
from tandem.engine.speculation.verify import Check, verify_rows

log = logging.getLogger("tandem.engine.scheduler.runner")


@dataclass
class PrefillStats:
    reused: int  # context tokens whose KV was already resident, or copied (of them: `copied`)
    computed: int  # context tokens run through the target now
    copied: int = 0  # context tokens whose KV was copied from a prompt of its scope being prefilled


class TargetRunner:
    """Owns a causal LM and runs forwards for its sequences. Not thread-safe: one caller at a time."""

    def __init__(self, loaded: LoadedModel, backend: str = "auto", prefill_chunk: int = 256):
        """`prefill_chunk`: the longest piece of a prompt one forward runs (PrefillPolicy)."""
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk
        self.model = loaded.model
        self.backend = make_backend(loaded.model, backend, loaded.quantized)
        self.costs = ForwardCosts()
        self.nominal_costs = NominalCosts()
        self.executor: BatchExecutor | None = None

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size

    @property
    def precision(self) -> str:
        """What the target computes in, which is what "lossless" is judged against: e.g.
        "GGUF Q4_1 + Q8_0" (the file's quantized weights, tandem.engine.native.quant) or "float32"."""
        impl = getattr(self.backend, "impl", None)
        if impl is not None:
            return impl.precision
        return str(next(self.model.parameters()).dtype).replace("torch.", "")

    @property
    def trees_ok(self) -> bool:
        """Whether generations may verify token trees here: the backend runs them, and the forward
        is not the batch-invariant one (there a chain's rows have plain decoding's bits; a tree row's
        ancestors sit at other key slots, so its attention sums in another order)."""
        impl = getattr(self.backend, "impl", None)
        return self.backend.trees and not (impl is not None and impl.batch_invariant)

    def new_sequence(self) -> "Sequence":
        return Sequence(self)

    def forward(self, cache, input_ids: list[int], *, all_logits: bool = True, alone: bool = False,
                tree: list[int] | None = None, check: Check | None = None) -> torch.Tensor | None:
        """Run `input_ids` on top of `cache` (which grows by len(input_ids)).

        Returns logits `# [len(input_ids), vocab]` float32 when `all_logits`, else None (prefill
        skips the LM head, ~20% of a small model's cost per token). `alone`: where the backend can
        (`backend.rows_alone`), each row is computed with the bits it would get in a one-token
        step, whatever the batch (for logprobs equal to plain decoding's); such forwards are slower
        and left out of the cost model. `tree`: the block is a token tree (NativeLlama.forward_batch:
        parents of its rows), where `backend.trees`; it costs what a chain of as many tokens costs.
        `check`: the block's verification, run on these logits (tandem.engine.speculation.verify.verify_rows;
        the step loop runs every row's check of a step together); its outcome lands in the check.
        """
        alone = alone and self.backend.rows_alone
        if self.executor is not None:
            return self.executor.forward(cache, input_ids, all_logits, alone, tree, check)
        if not all_logits and tree is None and len(input_ids) > self.prefill_chunk:
            # A long prompt in pieces: attention memory grows with piece x context, not context^2
            # (an 8k prompt in one piece is slower too: 4,096 tokens 9.6 s whole vs 6.7 s in 256s).
            for at in range(0, len(input_ids), self.prefill_chunk):
                self.backend.forward(cache, input_ids[at : at + self.prefill_chunk], False)
            return None
        start = time.perf_counter()
        logits = self.backend.forward(cache, input_ids, all_logits, alone, tree)
        if all_logits and not alone:
            self.costs.observe(len(input_ids), time.perf_counter() - start)
        if check is not None:
            verify_rows([check], [logits])
        return logits

    def prefill(self, cache, input_ids: list[int], scope: str | None = None) -> int:
        """The KV of a prompt's tokens on top of `cache` (no logits). In the step loop, a prompt
        of a `scope` may copy its first tokens from one being prefilled there
        (BatchExecutor.prefill). Returns the tokens copied rather than computed."""
        if self.executor is not None:
            return self.executor.prefill(cache, input_ids, scope)
        self.forward(cache, input_ids, all_logits=False)
        return 0

    def enable_batching(self, prefill: "PrefillPolicy | None" = None) -> "BatchExecutor":
        """From now on one step loop runs every forward: generations attached to it
        (`BatchExecutor.attach`) and blocks of concurrent callers run batched, and prompts are
        prefilled in pieces that share steps with decoding (`prefill`)."""
        if self.executor is None:
            policy = prefill or PrefillPolicy(max_piece=self.prefill_chunk)
            self.executor = BatchExecutor(self, policy)
        return self.executor


class Sequence:
    """One sequence's committed tokens and KV cache (see the module docstring for the invariant)."""

    def __init__(self, runner: TargetRunner):
        self.runner = runner
        self.cache = runner.backend.new_cache()
        self.ids: list[int] = []
        # Whose prompts may lend this one their KV while both are prefilled (a tenant's cache
        # salt; the verifier sets it): None, none (BatchExecutor._follow).
        self.scope: str | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def cached_len(self) -> int:
        return self.runner.backend.cache_len(self.cache)

    def kv_parts(self) -> tuple[int, tuple[int, int] | None, int | None]:
        """What this sequence's KV costs: (committed tokens not read from a shared prefix, the shared
        prefix as (the identity of the storage it lies in, its length) or None, the identity of
        this sequence's own storage or None). A prefix is counted once however many sequences read
        it, and not at all while the sequence whose own storage it lies in is counted
        (llama.KVPrefix)."""
        backend = self.runner.backend
        if not hasattr(backend, "kv_held"):
            return len(self.ids), None, None
        _, prefix = backend.kv_held(self.cache)
        return len(self.ids) - (prefix[1] if prefix else 0), prefix, backend.own_key(self.cache)

    def set_context(self, context_ids: list[int]) -> PrefillStats:
        """Make the committed tokens equal `context_ids`, reusing the longest resident prefix.

        A later turn of a conversation extends the previous one, so only its new tokens are computed;
        a context that diverges earlier rolls the cache back to the divergence first.
        """
        if not context_ids:
            raise ValueError("a sequence needs at least one context token")
        common = common_prefix_len(self.ids[: self.cached_len], context_ids)
        # The cache may hold at most context[:-1]: the last context token stays pending.
        keep = min(common, len(context_ids) - 1)
        self.rollback(keep)
        todo = context_ids[keep:-1]
        copied = self.runner.prefill(self.cache, todo, self.scope) if todo else 0
        self.ids = list(context_ids)
        return PrefillStats(reused=keep + copied, computed=len(todo) - copied, copied=copied)

    def shareable(self, context_ids: list[int]) -> int:
        """How many of `context_ids`' positions a sequence sharing from this one (`share_from`)
        would read in place rather than hold itself (0 where the backend copies)."""
        backend = self.runner.backend
        if not hasattr(backend, "shareable"):
            return 0
        n = min(common_prefix_len(self.ids[: self.cached_len], context_ids), len(context_ids) - 1)
        return backend.shareable(self.cache, n) if n > 0 else 0

    def block_inputs(self, drafts: list[int]) -> list[int]:
        """A step's forward input: the pending token, then the drafts."""
        assert self.cached_len == len(self.ids) - 1, "cache must hold ids[:-1] between steps"
        return [self.ids[-1], *drafts]

    @staticmethod
    def tree_rows(parents: list[int]) -> list[int]:
        """The forward's row parents for a token tree behind the pending token (row 0)."""
        return [-1] + [p + 1 for p in parents]

    def forward_block(self, drafts: list[int], *, alone: bool = False, check: Check | None = None) -> torch.Tensor:
        """One target forward over the pending token and `drafts`; logits `# [k+1, vocab]`.
        `alone`: each row as a one-token step computes it; `check`: the step's verification, run
        on these logits (TargetRunner.forward)."""
        return self.runner.forward(self.cache, self.block_inputs(drafts), alone=alone, check=check)

    def forward_tree(self, drafts: list[int], parents: list[int], *, check: Check | None = None) -> torch.Tensor:
        """One target forward over the pending token and a token tree (`parents[i]`: the draft node
        that node i follows, -1 for the pending token; topological order); logits `# [k+1, vocab]`,
        row i+1 after node i. Then `commit_tree` keeps the accepted path."""
        return self.runner.forward(self.cache, self.block_inputs(drafts), tree=self.tree_rows(parents), check=check)

    def commit_tree(self, tokens: list[int], nodes: list[int]) -> None:
        """`commit` after `forward_tree`: `nodes` are the accepted path's node indices (the first
        len(nodes) of `tokens`); their KV moves next to the pending token's, the rest is dropped."""
        start = len(self.ids) - 1
        self.runner.backend.keep_path(self.cache, start, [0] + [i + 1 for i in nodes])
        self.commit(tokens)

    def commit(self, tokens: list[int]) -> None:
        """Append the step's committed tokens (accepted drafts + one recovered/bonus token) and drop
        the KV of everything after the new pending token."""
        self.ids.extend(tokens)
        self.rollback(len(self.ids) - 1)

    def truncate(self, length: int) -> None:
        """Keep the first `length` committed tokens, the last of them pending (its KV dropped)."""
        if not 0 < length <= len(self.ids):
            raise ValueError(f"cannot keep {length} of {len(self.ids)} tokens")
        del self.ids[length:]
        self.rollback(length - 1)

    def share_from(self, other: "Sequence", length: int) -> None:
        """Take the first `length` positions of another sequence's KV instead of computing them (its
        whole attention runs read in place where the backend can, the rest copied: both stay
        independent); then `set_context` computes only the rest."""
        self.runner.backend.copy_prefix(other.cache, self.cache, length)
        self.ids = list(other.ids[:length])

    SHARE_MIN_TOKENS = SHARE_MIN_TOKENS

    def share_longest(self, donors: Iterable["Sequence"], context_ids: list[int]) -> int:
        """Copy the KV of the longest prefix of `context_ids` that one of `donors` holds (a common
        system prompt, a tool schema) into this sequence, when that beats what it holds itself by at
        least SHARE_MIN_TOKENS. The last context token stays pending, so at most len - 1 positions
        are taken. Returns the length copied (0: nothing worth sharing, or a backend without it).

        Example: donors hold [sys..., toolsA..., q1...]; context [sys..., toolsA..., q2...] takes
        len(sys + toolsA) positions, then `set_context` computes only q2."""
        if not self.runner.backend.shares_prefix:
            return 0
        own = common_prefix_len(self.ids[: self.cached_len], context_ids)
        best, donor = own, None
        for other in donors:
            if other is self:
                continue
            n = common_prefix_len(other.ids[: other.cached_len], context_ids)
            if n > best:
                best, donor = n, other
        best = min(best, len(context_ids) - 1)
        if donor is None or best - own < self.SHARE_MIN_TOKENS:
            return 0
        self.share_from(donor, best)
        return best

    def rollback(self, length: int) -> None:
        """Crop the KV cache to its first `length` entries (a no-op when it is not longer)."""
        self.runner.backend.crop(self.cache, length)
