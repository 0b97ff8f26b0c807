"""What a proposer costs per committed token, without a target: suffix decoding (chains and trees,
with and without a cross-session store) against prompt lookup, on the dev sets' real prompts.

Each prompt is read (the first propose indexes it), then 128 tokens are committed one at a time
(the tail of the next prompt, text of the same kind), each followed by the step's calls (on_commit,
peek, propose); the store, where there is one, keeps every earlier prompt's "answer". Prints the
first propose's time and the per-step median, mean and p99. Run it alone: it is timing.

    .venv/bin/python scripts/suffix_cost.py bfcl_multiple humaneval
"""

from __future__ import annotations

import statistics
import sys
import time

from tandem.engine.config import SamplingParams
from tandem.engine.models import apply_chat_template, load_tokenizer
from tandem.engine.proposers import NgramProposer
from tandem.engine.suffix import SuffixProposer, SuffixStore
from tandem.tools.datasets import records_for, to_chat

PROPOSERS = {
    "ngram": lambda store: NgramProposer(),
    "suffix chains, own tokens": lambda store: SuffixProposer(None),
    "suffix chains, with store": lambda store: SuffixProposer(store),
    "suffix trees, with store": lambda store: SuffixProposer(store, trees=True),
}


def measure(prompts: list[list[int]], make) -> tuple[list[float], list[float]]:
    sampling = SamplingParams()
    store = SuffixStore()
    first, steps = [], []
    for i, prompt in enumerate(prompts):
        answer = prompts[(i + 1) % len(prompts)][-128:]
        proposer = make(store)
        proposer.begin(len(prompt))
        ids = list(prompt)
        start = time.perf_counter()
        proposer.peek(ids)
        proposer.propose(ids, 8, sampling, None)
        first.append(time.perf_counter() - start)
        for tok in answer:
            ids.append(tok)
            start = time.perf_counter()
            proposer.on_commit(ids, [tok], 8)
            proposer.peek(ids)
            proposer.propose(ids, 8, sampling, None)
            steps.append(time.perf_counter() - start)
        proposer.finish(ids)
    return first, steps


def main(sets: list[str]) -> None:
    _, tokenizer, _ = load_tokenizer(progress=False)
    for name in sets:
        prompts = [apply_chat_template(tokenizer, to_chat(r)) for r in records_for(name, 10)]
        print(f"{name}: {len(prompts)} prompts, {statistics.mean(map(len, prompts)):.0f} tokens on average")
        for label, make in PROPOSERS.items():
            first, steps = measure(prompts, make)
            steps.sort()
            print(f"  {label:28s} first propose {statistics.median(first) * 1e3:5.2f} ms   per step: median "
                  f"{statistics.median(steps) * 1e6:5.1f} us, mean {statistics.mean(steps) * 1e6:5.1f} us, "
                  f"p99 {steps[int(len(steps) * 0.99)] * 1e6:5.1f} us")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bfcl_multiple", "humaneval"])
