"""Adaptive block length: speculate exactly as much as pays, down to nothing.

For a block of k drafts with conditional acceptance rates a_1..a_k (a_i = P(draft i accepted | drafts
before it accepted)), the expected tokens committed by one step are

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k

and the step costs C(k) = forward(k + 1 tokens) + drafting(k). We pick k maximising E(k) / C(k);
k = 0 is plain decoding (E = 1, C = forward(1)), so speculation is chosen only where it is expected to
beat plain decoding. Worked example with docs/design.md's CPU costs (forward(9) ~ 1.4 forward(1)): eight
drafts pay only if E(8) > 1.4; with a flat a = 0.3 per position E(8) ~ 1.43 (barely), while k = 2 gives
E(2) = 1.39 for ~1.1 the cost, so k = 2 wins.

Acceptance is tracked per proposer and confidence bucket (for prompt lookup: the matched suffix
length, which predicts acceptance far better than an average), per draft position. Each sequence
keeps its own counts, shrunk towards runner-wide counts, which are shrunk towards a fixed prior: a new
session starts from what other sessions measured and adapts to its own text within a few steps.

A choice of k = 0 produces no new evidence, so on its own it would be final: a session whose text
turns repetitive half-way would never find out. Two things keep the controller learning:

- Evidence fades: each new observation of a bucket discounts the older ones (`FORGET` per session,
  `SHARED_FORGET` runner-wide), so estimates follow the text as it is now, not as it was.
- Probes: when a prompt-lookup bucket's offers keep being declined, its `interval`-th decline
  drafts a few tokens anyway (`probe`: as many as cost about as little as one), which measures
  acceptance again and re-measures the cost of the forward. Draft-model offers are not probed (a
  probe would pay the model's own steps too). Each probe doubles the bucket's interval (up to
  `PROBE_MAX_INTERVAL`); drafting by plan resets it.
  Long prompt-lookup matches (8+ tokens: text the context continues) are always worth a look: their
  first decline is probed and their interval never exceeds `LONG_MATCH_MAX_INTERVAL`.

Token trees (suffix decoding's, tandem.engine.speculation.suffix.best_tree) are counted apart, per node rank
rather than per position: nodes come best first, so a k-node tree is the first k nodes, and
E(k) = 1 + P_1 + ... + P_k where P_i = P(node i lies on the accepted path), measured as such
(siblings exclude each other, so conditional rates would not multiply). Their prior is the chain's
prior compounded (P_i = a^i).

Worked example: on a host where a second token costs as much as the first (forward(2) = 2
forward(1)), drafting never pays and every offer is declined; a short-match bucket is probed at its
8th, 24th, 56th, 120th, 184th ... decline (then every 64th), each probe costing one extra token's
forward (on such a host the cheapest probe is a single draft), so over 500 steps about 9 probes of
one bucket: within noise of plain decoding. When the text turns repetitive, long matches
appear and are looked at at once; their drafts are accepted, the faded estimate rises within a
probe or two, and drafting by plan resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.model.backends import ForwardCosts

MAX_POSITIONS = 64

# Prior conditional acceptance by bucket (n-gram: matched length, grouped; 0: unknown). Only a
# starting point: measured counts take over within a few steps.
_PRIOR = {0: 0.3, 1: 0.2, 2: 0.35, 3: 0.45, 4: 0.55, 5: 0.65, 6: 0.75, 7: 0.85}
# A draft model's bucket is the probability it gives its first draft (proposers.confidence_bucket).
_MODEL_PRIOR = {0: 0.3, 1: 0.1, 2: 0.25, 3: 0.4, 4: 0.55, 5: 0.7, 6: 0.8, 7: 0.9}
_PRIOR_WEIGHT = 4.0  # pseudo-observations of the prior
_SESSION_SHRINK = 8.0  # pseudo-observations of the runner-wide estimate in a session's estimate

FORGET = 0.9  # weight of a session's older evidence at each new observation (~10 steps of memory)
SHARED_FORGET = 0.98  # the same for the runner-wide counts (~50 observations of memory)
PROBE_INTERVAL = 8  # declines of a bucket before its first probe
PROBE_MAX_INTERVAL = 64
LONG_MATCH = 6  # prompt lookup's bucket of 8+ matched tokens (see _bucket)
LONG_MATCH_MAX_INTERVAL = 16
PROBE_MAX_DRAFTS = 4  # a probe drafts 1..4 tokens: the most that cost about as little as the fewest


def _group(length: int) -> int:
    """Match lengths: 1, 2, 3, 4 stay; 5-7 -> 5; 8-15 -> 6; 16 and more -> 7."""
    if length <= 4:
        return max(0, length)
    return 5 if length < 8 else 6 if length < 16 else 7


def _bucket(proposer: str, bucket: int, tree: bool = False) -> tuple[str, int]:
    """Prompt lookup's match lengths grouped (_group); suffix decoding's too, its matches in the
    cross-session store (bucket = 16 + length) apart from the session's own (8 + group); trees
    apart from chains (proposer "<name>/tree"). Other proposers' buckets (0-7) are taken as they are."""
    if tree:
        return proposer + "/tree", _bucket(proposer, bucket)[1]
    if proposer == "ngram":
        return proposer, _group(bucket)
    if proposer == "suffix":
        return proposer, _group(bucket) if bucket < 16 else 8 + _group(bucket - 16)
    return proposer, max(0, min(bucket, 7))


@dataclass
class AcceptanceCounts:
    # (proposer, bucket) -> per position [reached, accepted]
    counts: dict[tuple[str, int], list[list[float]]] = field(default_factory=dict)
    # proposer -> bucket -> how often a costly look found that bucket (a draft model's confidence)
    seen: dict[str, dict[int, float]] = field(default_factory=dict)
    # proposer -> seconds per drafted token, runner-wide: a new sequence's first step knows what
    # a look at the draft model costs (unknown, every session looked at its first step, and a
    # first look reads the prompt: measured 35 ms of 512 tokens, several target steps)
    draft_cost: dict[str, float] = field(default_factory=dict)

    def row(self, key: tuple[str, int]) -> list[list[float]]:
        if key not in self.counts:
            self.counts[key] = [[0.0, 0.0] for _ in range(MAX_POSITIONS)]
        return self.counts[key]

    def observe(self, key: tuple[str, int], drafted: int, accepted: int, forget: float = 1.0) -> None:
        """Count one verified block; `forget` < 1 first discounts the bucket's older evidence."""
        row = self.row(key)
        if forget < 1.0:
            for cell in row:
                cell[0] *= forget
                cell[1] *= forget
        for i in range(min(drafted, MAX_POSITIONS)):
            row[i][0] += 1
            if i < accepted:
                row[i][1] += 1
            else:
                break  # positions after the first rejection were not tested

    def observe_tree(self, key: tuple[str, int], drafted: int, accepted_nodes: list[int], forget: float = 1.0) -> None:
        """Count one verified tree of `drafted` nodes: every rank was offered, the path's nodes
        were accepted (unconditional counts, see the module docstring)."""
        row = self.row(key)
        if forget < 1.0:
            for cell in row:
                cell[0] *= forget
                cell[1] *= forget
        on_path = set(accepted_nodes)
        for i in range(min(drafted, MAX_POSITIONS)):
            row[i][0] += 1
            if i in on_path:
                row[i][1] += 1


class BlockLengthController:
    """Chooses k per step. One per sequence; `shared` and `costs` are the runner's."""

    def __init__(self, max_k: int, costs: ForwardCosts, shared: AcceptanceCounts, *, adaptive: bool = True):
        self.max_k = max_k
        self.costs = costs
        self.shared = shared
        self.own = AcceptanceCounts()
        self.adaptive = adaptive
        self.draft_cost_per_token: dict[str, float] = {}
        # per bucket: [declines since the last probe or draft, current probe interval]
        self._probes: dict[tuple[str, int], list[int]] = {}
        self._probing: tuple[str, int] | None = None  # the bucket of the probe in flight
        self.probes = 0  # probes taken (for tests and stats)

    def rates(self, proposer: str, bucket: int, k: int, tree: bool = False) -> list[float]:
        """Per position: the conditional acceptance rate; for a tree (`tree`), per node rank: the
        probability that the node is on the accepted path."""
        key = _bucket(proposer, bucket, tree)
        if proposer == "suffix":  # a match is a match, in the session or in the store
            prior = _PRIOR.get(key[1] % 8, 0.3)
        else:
            prior = (_PRIOR if proposer == "ngram" else _MODEL_PRIOR if proposer == "model" else {}).get(key[1], 0.3)
        shared, own = self.shared.row(key), self.own.row(key)
        out = []
        p = prior  # the first position's prior is the bucket's; each later one inherits the estimate before it
        for i in range(k):
            s_reached, s_acc = shared[i]
            global_rate = (s_acc + _PRIOR_WEIGHT * p) / (s_reached + _PRIOR_WEIGHT)
            # A position no block has reached yet is expected to do as well as the one before it
            # (for a tree rank: a factor `prior` less likely). A fixed prior there made the
            # controller's first choice final: measured, at long cross-session suffix matches whose
            # first 3 positions were accepted 95% of the time, positions 4-8 stayed at the prior
            # 0.75, so 3 drafts looked best (the CPU's forward cost jumps at 5 tokens), only 3
            # were ever drafted, and the hybrid ran 1.2x where suffix decoding alone ran 1.4x.
            p = global_rate * prior if tree else global_rate
            o_reached, o_acc = own[i]
            out.append((o_acc + _SESSION_SHRINK * global_rate) / (o_reached + _SESSION_SHRINK))
        return out

    def choose(self, proposer: str, bucket: int, available: int, batch_tokens: int = 0,
               batch_committed: float = 0.0) -> int:
        """Best block length in 0..min(max_k, available); see `plan_detail`."""
        return self.plan_detail(proposer, bucket, available, batch_tokens, batch_committed)[0]

    def plain(self, batch_tokens: int = 0, batch_committed: float = 0.0) -> tuple[float, float]:
        """(expected committed tokens, cost in seconds) of a plain step; cost 0 = nothing measured."""
        return batch_committed + 1.0, self.costs.estimate(batch_tokens + 1) or 0.0

    def plan_detail(self, proposer: str, bucket: int, available: int, batch_tokens: int = 0,
                    batch_committed: float = 0.0, tree: bool = False) -> tuple[int, float, float]:
        """(best block length in 0..min(max_k, available), its expected committed tokens, its cost
        in seconds); cost 0 = nothing measured yet.

        Alone, this maximises E(k) / C(k). In a batch, the forward also carries `batch_tokens` of
        other sessions that commit `batch_committed` tokens, and its cost is that of all tokens:
        we maximise the batch's (batch_committed + E(k)) / C(batch_tokens + k + 1). Once the
        forward is compute-bound, C grows with every token and drafts must be likelier to pay,
        down to k = 0: plain batched decoding. Expected tokens and cost, rather than a choice
        alone, let a caller compare offers of different proposers (a hybrid's prompt lookup
        against its draft model) and price a costly look.
        """
        limit = min(self.max_k, available)
        plain = (0, *self.plain(batch_tokens, batch_committed))
        base = plain[2] or None
        if limit <= 0:
            return plain
        if not self.adaptive:  # fixed: always the most drafts (valued as if all accepted)
            return limit, batch_committed + 1.0 + limit, base or 1.0
        if base is None:  # nothing measured yet: one plain step measures the baseline
            return plain
        draft_cost = self._draft_cost(proposer) or 0.0
        best = plain
        expected, survive = 1.0, 1.0
        for k, rate in enumerate(self.rates(proposer, bucket, limit, tree), start=1):
            survive = rate if tree else survive * rate  # a tree's rates are already unconditional
            expected += survive
            cost = self.costs.estimate(batch_tokens + k + 1) + draft_cost * k
            if (batch_committed + expected) / cost > best[1] / best[2]:
                best = (k, batch_committed + expected, cost)
        return best

    def note_bucket(self, proposer: str, bucket: int) -> None:
        seen = self.shared.seen.setdefault(proposer, {})
        seen[bucket] = seen.get(bucket, 0.0) + 1.0

    def worth_peeking(self, proposer: str, available: int, alternative: tuple[float, float],
                      batch_tokens: int = 0, batch_committed: float = 0.0) -> bool:
        """Whether a costly look at `proposer`'s confidence (a draft model's first step) pays:
        over the buckets it has found so far, the expected rate of the better of (drafting at that
        bucket, the alternative plus the look's time) against the alternative without the look.
        `alternative` is (expected committed tokens, cost) of the best choice without it."""
        if not self.adaptive:
            return True
        look = self._draft_cost(proposer)
        alt_expected, alt_cost = alternative
        if look is None or alt_cost <= 0:
            return alt_cost > 0  # unmeasured look: take it, once the forward cost is known
        seen = self.shared.seen.get(proposer, {})
        # one pseudo-observation per bucket: every confidence is possible until measured otherwise
        weights = {b: seen.get(b, 0.0) + 1.0 for b in range(1, 8)}
        total = sum(weights.values())
        with_look = 0.0
        for b, w in weights.items():
            k, expected, cost = self.plan_detail(proposer, b, available, batch_tokens, batch_committed)
            drafting = expected / cost if k > 0 else 0.0
            with_look += w / total * max(drafting, alt_expected / (alt_cost + look))
        return with_look > alt_expected / alt_cost

    def probe(self, proposer: str, bucket: int, available: int, tree: bool = False) -> int:
        """An offer of `available` drafts was declined (the plan chose a plain step): how many
        drafts to verify anyway to test its bucket (0: not now). See the module docstring."""
        if not self.adaptive or available <= 0 or proposer not in ("ngram", "suffix"):
            # Only prompt lookup and suffix decoding are probed: their drafts cost nothing to
            # make, while a draft model's probe would pay its own steps on top of the larger forward.
            return 0
        key = _bucket(proposer, bucket, tree)
        long_match = key[1] % 8 >= LONG_MATCH
        state = self._probes.setdefault(key, [0, 1 if long_match else PROBE_INTERVAL])
        state[0] += 1
        if state[0] < state[1]:
            return 0
        cap = LONG_MATCH_MAX_INTERVAL if long_match else PROBE_MAX_INTERVAL
        state[0], state[1] = 0, min(cap, state[1] * 2)
        self._probing = key
        self.probes += 1
        return self._probe_len(available)

    def _probe_len(self, available: int) -> int:
        """Drafts in a probe: the largest k (up to PROBE_MAX_DRAFTS) whose forward costs within 5% of
        the cheapest probe, so it tests as many positions as come nearly free. Where small-row GEMMs
        are slow (2 tokens cost more than 5 on some hosts) that is several drafts, not one."""
        limit = max(1, min(available, self.max_k, PROBE_MAX_DRAFTS))
        costs = [self.costs.estimate(k + 1) for k in range(1, limit + 1)]
        if any(c is None for c in costs):
            return 1
        cheapest = min(costs)
        return max(k for k, c in enumerate(costs, start=1) if c <= 1.05 * cheapest)

    def observe(self, proposer: str, bucket: int, drafted: int, accepted: int,
                tree_nodes: list[int] | None = None) -> None:
        """One verified block; `tree_nodes`: it was a token tree and these nodes were accepted."""
        key = _bucket(proposer, bucket, tree_nodes is not None)
        if tree_nodes is not None:
            self.own.observe_tree(key, drafted, tree_nodes, FORGET)
            self.shared.observe_tree(key, drafted, tree_nodes, SHARED_FORGET)
        else:
            self.own.observe(key, drafted, accepted, FORGET)
            self.shared.observe(key, drafted, accepted, SHARED_FORGET)
        if self._probing == key:
            self._probing = None  # a probe's outcome: the interval already grew
        elif drafted and key in self._probes:
            del self._probes[key]  # drafting by plan: the bucket pays again; probe afresh if it stops

    def observe_draft_cost(self, proposer: str, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        per = seconds / tokens
        for costs in (self.draft_cost_per_token, self.shared.draft_cost):
            prev = costs.get(proposer)
            costs[proposer] = per if prev is None else 0.8 * prev + 0.2 * per

    def _draft_cost(self, proposer: str) -> float | None:
        """Seconds per drafted token: this sequence's measure, else the runner's (None: unmeasured)."""
        own = self.draft_cost_per_token.get(proposer)
        return own if own is not None else self.shared.draft_cost.get(proposer)
