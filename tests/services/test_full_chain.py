"""The whole chain, every part real: client -> gateway (HTTP + gRPC) -> verifier <- drafter, with
a real Valkey for registration and residency, on a tiny random Llama.

Checked: greedy output through the chain equals the single-process reference token for token (for
every strategy, over both APIs, streaming and not); a session's second turn lands on the verifier
that holds it (one of two) and prefills only its new tokens; a verifier that dies is replaced, and
the session is rebuilt there from the gateway's history; `tandem bench --endpoint` works over it.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import redis

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.scheduler.generate import Engine
from tandem.services.drafter.core import DrafterCore
from tandem.services.drafter.server import build_server as build_drafter
from tandem.services.drafter.settings import DrafterSettings
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.drafter_client import GrpcDrafterConnector
from tandem.services.verifier.server import build_server as build_verifier
from tandem.services.verifier.settings import VerifierSettings
from tandem.serving.residency import ResidencyPublisher
from tandem.tools.bench import run_bench
from tandem.tools.bench_remote import GatewayTarget
from tandem.tools.datasets import PromptRecord
from tandem.v1 import common_pb2, gateway_pb2

from test_gateway import Gateway

MESSAGES = [{"role": "user", "content": "the answer is the answer is the answer is"}]


class RealVerifier:
    def __init__(self, vid: str, loaded, redis_url: str, drafters: tuple[str, ...] = ()):
        self.publisher = ResidencyPublisher(redis_url, heartbeat_ttl_s=5, session_ttl_s=60)
        self.core = VerifierCore(VerifierSettings(verifier_id=vid, port=0, heartbeat_s=0.5, draft_wait_ms=200,
                                                  drafters=drafters),
                                 loaded, publisher=self.publisher, connector=GrpcDrafterConnector())
        self.server, port, _ = build_verifier(self.core)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.core.start(self.address)

    def stop(self) -> None:
        self.server.stop(None)
        self.core.stop()


class _Chain(tuple):
    """(gateway, verifiers), and `.drafter`: the drafter's core."""

    drafter: DrafterCore


@pytest.fixture
def chain(tiny_loaded, tiny_draft_loaded, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    dcore = DrafterCore(DrafterSettings(drafter_id="d0", draft_model=tiny_draft_loaded))
    dserver, dport = build_drafter(dcore)
    dserver.start()
    verifiers = [RealVerifier(f"v{i}", tiny_loaded, redis_url, drafters=(f"127.0.0.1:{dport}",)) for i in range(2)]
    gw = Gateway(tiny_loaded.tokenizer, model="tiny", redis_url=redis_url, drafters=(f"127.0.0.1:{dport}",),
                 verifiers=tuple(v.address for v in verifiers), poll_interval_s=0.5)
    time.sleep(0.6)  # one poll of the drafter's and verifiers' GetInfo
    parts = _Chain((gw, verifiers))
    parts.drafter = dcore
    yield parts
    gw.close()
    for v in verifiers:
        v.stop()
    dserver.stop(None)


def _reference(loaded, max_new: int, ignore_eos: bool = True) -> list[int]:
    ctx = apply_chat_template(loaded.tokenizer, MESSAGES)
    return Engine(loaded).generate(ctx, SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos),
                                   SpecConfig(strategy=DraftStrategy.none)).token_ids


def _grpc_generate(gw, strategy, session="", max_new=24, messages=MESSAGES):
    req = gateway_pb2.GenerateRequest(
        session_id=session,
        messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in messages]),
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True),
        speculation=common_pb2.SpeculationParams(strategy=strategy, adaptive=False, max_draft_tokens=4),
    )
    tokens, last = [], None
    for msg in gw.stub.Generate(req, timeout=30):
        assert msg.first_index == len(tokens) or not msg.token_ids
        tokens.extend(msg.token_ids)
        last = msg
    return tokens, last


@pytest.mark.parametrize("strategy", [common_pb2.DRAFT_STRATEGY_NONE, common_pb2.DRAFT_STRATEGY_NGRAM,
                                      common_pb2.DRAFT_STRATEGY_SUFFIX, common_pb2.DRAFT_STRATEGY_MODEL,
                                      common_pb2.DRAFT_STRATEGY_HYBRID])
def test_chain_output_equals_single_process_reference(chain, tiny_loaded, strategy):
    gw, _ = chain
    tokens, last = _grpc_generate(gw, strategy)
    assert tokens == _reference(tiny_loaded, 24)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    if strategy != common_pb2.DRAFT_STRATEGY_NONE:
        assert last.stats.drafted > 0, "the drafter must actually have been used"


def test_openai_client_streaming_and_not_equal_reference(chain, tiny_loaded):
    gw, _ = chain
    expected = _reference(tiny_loaded, 16, ignore_eos=False)
    expected_text = tiny_loaded.tokenizer.decode(expected, skip_special_tokens=True)
    reply = gw.openai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == expected_text
    assert {"drafted", "accepted", "mean_accepted_len"} <= set(reply.usage.speculation)
    stream = gw.openai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                               stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_text


def test_second_turn_sticks_to_its_verifier_and_prefills_only_new_tokens(chain):
    gw, verifiers = chain
    tokens1, last1 = _grpc_generate(gw, common_pb2.DRAFT_STRATEGY_NGRAM, session="conv")
    first = last1.verifier_id
    history = MESSAGES + [{"role": "assistant", "content": "the answer"}, {"role": "user", "content": "and again"}]
    for _ in range(2):
        _, last2 = _grpc_generate(gw, common_pb2.DRAFT_STRATEGY_NGRAM, session="conv", messages=history)
        assert last2.verifier_id == first
        assert last2.usage.cached_prompt_tokens > 0
        assert last2.stats.prefill_computed_tokens < last2.stats.prefill_reused_tokens
    holder = next(v for v in verifiers if v.core.settings.verifier_id == first)
    other = next(v for v in verifiers if v is not holder)
    assert "conv" in holder.core.session_ids() and "conv" not in other.core.session_ids()
    assert other.core.metrics.value("tandem_prefill_tokens_total", kind="computed") == 0


@pytest.mark.parametrize("strategy", [common_pb2.DRAFT_STRATEGY_MODEL, common_pb2.DRAFT_STRATEGY_HYBRID])
def test_a_second_turn_resumes_its_drafter_session_and_stays_lossless(chain, tiny_loaded, strategy):
    """The drafter parks a finished session's draft state; the next turn of that session (same
    verifier, same stream) resumes it, and its output still equals plain decoding of the target."""
    gw, _ = chain
    before = chain.drafter.stats()["sessions_resumed"]
    _grpc_generate(gw, strategy, session="agent")
    history = MESSAGES + [{"role": "assistant", "content": "the answer"}, {"role": "user", "content": "and again"}]
    tokens, last = _grpc_generate(gw, strategy, session="agent", messages=history)
    assert chain.drafter.stats()["sessions_resumed"] == before + 1
    assert last.stats.drafted > 0
    reference = Engine(tiny_loaded).generate(
        apply_chat_template(tiny_loaded.tokenizer, history), SamplingParams(max_new_tokens=24, ignore_eos=True),
        SpecConfig(strategy=DraftStrategy.none)).token_ids
    assert tokens == reference


def test_dead_verifier_session_moves_and_is_rebuilt(chain, tiny_loaded):
    gw, verifiers = chain
    _, last1 = _grpc_generate(gw, common_pb2.DRAFT_STRATEGY_NGRAM, session="moving")
    holder = next(v for v in verifiers if v.core.settings.verifier_id == last1.verifier_id)
    holder.stop()
    holder.publisher.evict_session("moving")  # what its residency TTL would do, without the wait
    tokens, last2 = _grpc_generate(gw, common_pb2.DRAFT_STRATEGY_NGRAM, session="moving")
    assert last2.verifier_id != last1.verifier_id
    assert tokens == _reference(tiny_loaded, 24)
    assert last2.stats.prefill_reused_tokens == 0, "the new verifier rebuilt the session from scratch"


def test_bench_through_the_gateway_matches_in_process(chain, tiny_loaded):
    gw, _ = chain
    records = [PromptRecord(id=str(i), dataset="tiny", category=None, system=None,
                            turns=[f"the answer is {i} the answer is {i} the answer"]) for i in range(3)]
    remote = run_bench(GatewayTarget(f"127.0.0.1:{gw.grpc_port}"), records, ["ar", "ngram", "model"], 12,
                       progress=False)
    local = run_bench(Engine(tiny_loaded), records, ["ar"], 12, tokenizer=tiny_loaded.tokenizer, progress=False)
    assert set(remote["modes"]) == {"ar", "ngram", "model"}
    assert remote["modes"]["ngram"]["lossless"] == 1.0 and remote["modes"]["model"]["lossless"] == 1.0
    for p_remote, p_local in zip(remote["prompts"], local["prompts"]):
        assert p_remote["modes"]["ar"]["tokens"] == p_local["modes"]["ar"]["tokens"]


def test_bench_sessions_through_the_gateway_a_tenant_per_mode(tiny_loaded, tiny_draft_loaded, redis_url, tmp_path):
    """`tandem bench --endpoint --mode-tenants`: each mode is a tenant of the gateway's key file and
    every conversation a session of it. Two turns run as one session (turn 2 reuses its KV); later
    sessions' first turns reuse a shared system prompt from their own mode's earlier session, and
    the first prompt's first turn reuses nothing in any mode, although every mode ran it: the
    verifier never hands one tenant (mode) another's prefill. Greedy through the chain: each mode
    equals plain decoding, and plain decoding the in-process engine's, turn by turn."""
    import json as json_mod

    from tandem.tools.bench_remote import mode_keys_from_file

    modes = ["ar", "ngram", "suffix"]
    keyfile = tmp_path / "keys.json"
    keyfile.write_text(json_mod.dumps({"tenants": {m: {"keys": [f"sk-bench-{m}-0123456789abcdef"]} for m in modes}}))
    redis.Redis.from_url(redis_url).flushdb()
    dcore = DrafterCore(DrafterSettings(drafter_id="d0", draft_model=tiny_draft_loaded))
    dserver, dport = build_drafter(dcore)
    dserver.start()
    verifier = RealVerifier("v0", tiny_loaded, redis_url, drafters=(f"127.0.0.1:{dport}",))
    gw = Gateway(tiny_loaded.tokenizer, model="tiny", redis_url=redis_url, drafters=(f"127.0.0.1:{dport}",),
                 verifiers=(verifier.address,), poll_interval_s=0.5, api_keys_file=keyfile)
    try:
        time.sleep(0.6)  # one poll of the drafter's and verifier's GetInfo
        system = " ".join(f"tool{i} takes a b and c" for i in range(12))
        recs = [PromptRecord(id=f"s{i}", dataset="agents", category=None, system=system,
                             turns=[f"call tool{i} with {i} {i + 1}", f"now tool{i + 3} please"]) for i in range(3)]
        address = f"127.0.0.1:{gw.grpc_port}"
        with pytest.raises(ValueError, match="tenant per mode"):
            run_bench(GatewayTarget(address, api_key="sk-bench-ar-0123456789abcdef"), recs, ["ar"], 4,
                      progress=False, turns=2)
        remote = run_bench(GatewayTarget(address, mode_keys=mode_keys_from_file(keyfile, modes)), recs, modes, 12,
                           progress=False, turns=2)
        local = run_bench(Engine(tiny_loaded), recs, ["ar"], 12, tokenizer=tiny_loaded.tokenizer, progress=False,
                          turns=2)
    finally:
        gw.close()
        verifier.stop()
        dserver.stop(None)
    assert "tenant per mode" in remote["config"]["prefix_sharing"]
    assert all(remote["modes"][m]["lossless"] == 1.0 for m in modes)
    for i, (p_remote, p_local) in enumerate(zip(remote["prompts"], local["prompts"])):
        for t in range(2):
            assert (p_remote["turns"][t]["modes"]["ar"]["tokens"] == p_local["turns"][t]["modes"]["ar"]["tokens"]), (i, t)
        for m in modes:
            first, second = (p_remote["turns"][t]["modes"][m] for t in range(2))
            if i == 0:
                assert first["prefill_reused_tokens"] == 0, f"{m} was handed another mode's prefill"
            else:
                assert first["prefill_reused_tokens"] >= 40, f"{m}: the system prompt of its own earlier session"
            assert second["prefill_reused_tokens"] > first["prompt_tokens"] / 2, f"{m}: its own first turn"
    with pytest.raises(ValueError, match="no tenant 'model'"):
        mode_keys_from_file(keyfile, ["ar", "model"])


def test_loadtest_over_the_chain(chain, tmp_path):
    from tandem.tools.loadtest import plot_loadtest, run_loadtest

    gw, verifiers = chain
    records = [PromptRecord(id=str(i), dataset="tiny", category=None, system=None,
                            turns=[f"the answer is {i} the answer is", "and again the answer"]) for i in range(4)]
    urls = [f"http://127.0.0.1:{v.core.metrics.serve(0, '127.0.0.1')}/metrics" for v in verifiers]
    result = run_loadtest(gw.url, records, [1, 2], turns=2, max_tokens=8, duration_s=60, metrics_urls=urls)
    for row in result["results"]:  # what the verifiers did in each phase, from their own /metrics
        server = row["server"]
        assert server["prefill_computed_tokens"] > 0 and server["prefill_reused_tokens"] > 0  # second turns
        assert server["steps"] > 0 and server["rows_per_step"] >= 1
        assert server["recomputed_tokens"] == server["evictions"] == 0  # nothing evicted at this size
        assert 0 < server["kv_used_max_tokens"] <= server["kv_capacity_tokens"]
    keys = {"concurrency", "speculation", "tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms", "acceptance_rate", "residency_hit_rate", "cached_share"}
    assert [(r["concurrency"], r["speculation"]) for r in result["results"]] == [(1, False), (1, True), (2, False), (2, True)]
    for row in result["results"]:
        assert keys <= set(row)
        assert row["errors"] == 0 and row["tokens_per_s"] > 0 and row["ttft_p50_ms"] > 0
        # the workers start together, so there is a window with every one of them in flight
        assert row["steady_tokens_per_s"] > 0 and 0 < row["steady_window_s"] <= row["wall_s"]
        assert row["residency_hit_rate"] == 1.0, "every second turn found its session's KV"
        assert row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["cached_share"] < 1  # second turns' history cached, first turns' prompts not
    assert result["results"][0]["acceptance_rate"] is None  # speculation off drafts nothing
    plot_loadtest(result, str(tmp_path / "lt.png"))
    assert (tmp_path / "lt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # speculation by the drafter's hybrid: its second turns resume their drafter sessions
    resumed = chain.drafter.stats()["sessions_resumed"]
    hybrid = run_loadtest(gw.url, records[:1], [1], turns=2, max_tokens=8, duration_s=60, strategy="hybrid")
    assert hybrid["config"]["strategy"] == "hybrid" and all(r["errors"] == 0 for r in hybrid["results"])
    # (whether a step drafts is the block-length controller's call from measured costs, so this
    # asserts no acceptance figure: under a loaded CPU it chose plain steps once. The drafter
    # session opens at the start of every hybrid turn whatever the controller does.)
    assert chain.drafter.stats()["sessions_resumed"] == resumed + 1
    for v in verifiers:
        v.core.metrics.close()


def test_mixed_loadtest_sends_long_prompts_beside_running_streams(chain):
    from tandem.tools.loadtest import run_mixed

    gw, _ = chain
    records = [PromptRecord(id=str(i), dataset="tiny", category=None, system=None,
                            turns=[f"the answer is {i} the answer is", "and again the answer"]) for i in range(4)]
    result = run_mixed(gw.url, records, [2], long_tokens=[120], long_gap_s=0.1, max_tokens=8, duration_s=4,
                       speculation=(True,))
    base, mixed = result["mixed"]
    assert (base["with_long"], mixed["with_long"]) == (False, True)
    assert base["long_prompts"] == 0 and base["gap_during_long_p99_ms"] is None
    assert base["errors"] == mixed["errors"] == mixed["long_errors"] == 0
    assert mixed["long_prompts"] >= 1 and min(mixed["long_prompt_tokens"]) > 60, "the long prompts are long"
    assert len(mixed["long_ttft_ms"]) == mixed["long_prompts"]
    assert mixed["gap_p99_ms"] > 0 and mixed["tokens_per_s"] > 0
    assert result["config"]["long_tokens"] == [120]


def test_demo_compares_like_for_like_over_the_chain(chain):
    """The README's demo against a real gateway, verifiers and drafter: every pair's speculative
    text equals plain decoding, both sides found the same prompt KV resident, and the summary line
    reports a median with its range (or says that nothing was drafted)."""
    import io

    from rich.console import Console

    from tandem.tools.demo import PAIRS, compare, run_demo

    gw, _ = chain
    console = Console(file=io.StringIO(), width=200)
    prompt = "the list is one two three four one two three four one two three"
    assert run_demo(gw.url, console, strategy="ngram", prompt=prompt, follow_up="and again", max_tokens=16) is True
    text = console.file.getvalue()
    assert f"{PAIRS} pairs in alternating order, prompt KV resident for both" in text
    assert "median (range" in text and "identical to plain decoding in every pair: yes" in text
    # The summary's arithmetic, on made-up timings: medians and ranges of per-pair ratios.
    def run(seconds, ttft, n, drafted, text="t", cached=5):
        return {"seconds": seconds, "ttft": ttft, "text": text, "usage": {
            "completion_tokens": n, "speculation": {"drafted": drafted}, "prompt_tokens_details": {"cached_tokens": cached}}}
    c = compare([(run(2.0, 0.5, 31, 20), run(4.0, 1.0, 31, 0)), (run(1.0, 0.5, 31, 20), run(4.0, 0.5, 31, 0)),
                 (run(3.0, 0.5, 31, 20), run(3.0, 0.5, 31, 0))])
    assert (c["decode_min"], c["decode_median"], c["decode_max"]) == (1.0, 2.0, 7.0)
    assert c["identical"] and c["speculated"] and c["cached_equal"]
    assert not compare([(run(1, 0.1, 9, 2), run(1, 0.1, 9, 0, text="u", cached=0))])["identical"]


def test_penalties_and_bias_through_the_stack_equal_plain_decoding(chain, tiny_loaded):
    """Sampling controls (OpenAI's penalties and logit_bias, the repetition penalty) through the gateway
    and the verifier: every strategy gives the in-process plain decoding's tokens."""
    gw, _ = chain
    controls = dict(frequency_penalty=0.3, presence_penalty=0.2, logit_bias={"5": 3.0, "17": -100.0})
    extra = {"repetition_penalty": 1.1}
    ctx = apply_chat_template(tiny_loaded.tokenizer, MESSAGES)
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=0.3, presence_penalty=0.2,
                              repetition_penalty=1.1, logit_bias=((5, 3.0), (17, -100.0)))
    expected = Engine(tiny_loaded).generate(ctx, sampling, SpecConfig(strategy=DraftStrategy.none)).token_ids
    plain = Engine(tiny_loaded).generate(ctx, SamplingParams(max_new_tokens=24, ignore_eos=True),
                                         SpecConfig(strategy=DraftStrategy.none)).token_ids
    assert expected != plain, "the controls change the output"
    for strategy in ("none", "ngram", "model"):
        reply = gw.openai.completions.create(
            model="tiny", prompt=ctx, max_tokens=24, temperature=0, **controls,
            extra_body={**extra, "ignore_eos": True, "speculation": {"strategy": strategy, "adaptive": False,
                                                                     "max_draft_tokens": 4}},
        )
        text = reply.choices[0].text
        assert text == tiny_loaded.tokenizer.decode(expected, skip_special_tokens=True), strategy


def test_stop_strings_through_the_stack(chain, tiny_loaded):
    """A stop string across a token boundary: the text ends before it, finish_reason stop, and every
    strategy stops at the same token (usage) as plain decoding."""
    gw, _ = chain
    ctx = apply_chat_template(tiny_loaded.tokenizer, MESSAGES)
    full = Engine(tiny_loaded).generate(ctx, SamplingParams(max_new_tokens=24, ignore_eos=True),
                                        SpecConfig(strategy=DraftStrategy.none)).token_ids
    text = tiny_loaded.tokenizer.decode(full, skip_special_tokens=True)
    words = text.split(" ")
    stop = f"{words[3][-1:]} {words[4][:1]}"
    usage = set()
    for strategy in ("none", "ngram", "model"):
        for stream in (False, True):
            kwargs = dict(model="tiny", prompt=ctx, max_tokens=24, temperature=0, stop=[stop, "never-there"],
                          extra_body={"ignore_eos": True, "speculation": {"strategy": strategy}})
            if stream:
                chunks = list(gw.openai.completions.create(stream=True, **kwargs))
                got = "".join(c.choices[0].text for c in chunks if c.choices)
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
            else:
                reply = gw.openai.completions.create(**kwargs)
                got, _ = reply.choices[0].text, usage.add(reply.usage.completion_tokens)
                assert reply.choices[0].finish_reason == "stop"
            assert got == text[: text.find(stop)], (strategy, stream)
    assert len(usage) == 1 and usage.pop() < 24


def test_logprobs_through_the_stack_with_the_openai_client(chain, tiny_loaded):
    """Chat logprobs (top 3) and completions logprobs (top 2), streamed and not, every strategy: the
    same tokens, and logprobs equal to plain decoding's to the bit (a request with logprobs has its
    blocks computed with each row's one-token bits, tandem.engine.model.gemm.rows_alone; on a machine
    where our kernels do not load, within float rounding)."""
    from tandem.engine.model.backends import NativeBackend

    exact = NativeBackend(tiny_loaded.model).rows_alone
    gw, _ = chain
    tok = tiny_loaded.tokenizer
    seen = {}
    for strategy in ("none", "ngram", "model"):
        extra = {"ignore_eos": True, "speculation": {"strategy": strategy, "adaptive": False, "max_draft_tokens": 4}}
        reply = gw.openai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                                  logprobs=True, top_logprobs=3, extra_body=extra)
        content = reply.choices[0].logprobs.content
        assert len(content) == reply.usage.completion_tokens == 16
        assert "".join(c.token for c in content) == reply.choices[0].message.content
        assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
        stream = list(gw.openai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                                        logprobs=True, top_logprobs=3, stream=True, extra_body=extra))
        streamed = [c for e in stream if e.choices and e.choices[0].logprobs for c in e.choices[0].logprobs.content]
        assert [c.token for c in streamed] == [c.token for c in content]
        comp = gw.openai.completions.create(model="tiny", prompt="the answer is", max_tokens=8, temperature=0,
                                            logprobs=2, extra_body=extra)
        lp = comp.choices[0].logprobs
        assert "".join(lp.tokens) == comp.choices[0].text and len(lp.top_logprobs[0]) == 2
        assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
        seen[strategy] = ([c.token for c in content], [c.logprob for c in content], lp.tokens, lp.token_logprobs)
    ref = seen["none"]
    for strategy in ("ngram", "model"):
        got = seen[strategy]
        assert got[0] == ref[0] and got[2] == ref[2], strategy
        if exact:
            assert got[1] == ref[1] and got[3] == ref[3], strategy
        assert got[1] == pytest.approx(ref[1], abs=1e-4) and got[3] == pytest.approx(ref[3], abs=1e-4), strategy
    assert tok is not None


def test_logprobs_over_grpc(chain, tiny_loaded):
    gw, _ = chain
    req = gateway_pb2.GenerateRequest(
        prompt="the answer is",
        sampling=common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True, top_logprobs=2),
        speculation=common_pb2.SpeculationParams(strategy=common_pb2.DRAFT_STRATEGY_NGRAM),
    )
    msgs = list(gw.stub.Generate(req, timeout=30))
    tokens = [t for m in msgs for t in m.token_ids]
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == tokens and len(tokens) == 8
    assert all(len(lp.top_ids) == 2 and lp.top_logprobs[0] >= lp.logprob - 1e-6 for lp in lps)
    plain = list(gw.stub.Generate(gateway_pb2.GenerateRequest(
        prompt="the answer is", sampling=common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True)), timeout=30))
    assert not any(m.logprobs for m in plain)  # only when asked


def test_n_choices_share_the_prompts_kv_and_replay_their_seeds(chain, tiny_loaded):
    """n = 3 sampled choices: each is the in-process plain sampling with seed + i, the prompt is
    prefilled once (the choices report its KV as cached), and n > 1 is refused with a session."""
    gw, _ = chain
    ctx = apply_chat_template(tiny_loaded.tokenizer, MESSAGES) * 3  # > 32 tokens: worth sharing
    reply = gw.openai.completions.create(model="tiny", prompt=ctx, max_tokens=12, temperature=0.8, seed=5, n=3,
                                         extra_body={"ignore_eos": True, "speculation": {"strategy": "none"}})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    engine = Engine(tiny_loaded)
    for i, choice in enumerate(reply.choices):
        expected = engine.generate(ctx, SamplingParams(temperature=0.8, seed=5 + i, max_new_tokens=12, ignore_eos=True),
                                   SpecConfig(strategy=DraftStrategy.none)).token_ids
        assert choice.text == tiny_loaded.tokenizer.decode(expected, skip_special_tokens=True), i
    assert len({c.text for c in reply.choices}) > 1, "different seeds, different samples"
    assert reply.usage.completion_tokens == 36 and reply.usage.prompt_tokens == len(ctx)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 32, "the choices reused the warm-up's prompt KV"
    r = gw.http.post("/v1/completions", json={"prompt": "x", "n": 2}, headers={"X-Session-Id": "s"})
    assert r.status_code == 400 and "session" in r.json()["error"]["message"]
    r = gw.http.post("/v1/completions", json={"prompt": "x", "n": 2, "stream": True}, headers={"X-Session-Id": "s"})
    assert r.status_code == 400 and "session" in r.json()["error"]["message"]


def test_n_choices_streamed_are_the_same_choices_interleaved(chain, tiny_loaded):
    """n = 3 streamed with the official client, chat and completions: every chunk names its choice,
    each choice's text is the unstreamed reply's choice with the same seed (speculation on), each
    choice ends once, and include_usage sends one usage chunk counting the prompt once."""
    gw, _ = chain
    extra = {"ignore_eos": True}
    kw = dict(model="tiny", max_tokens=10, temperature=0.9, seed=11, n=3, extra_body=extra)
    whole = gw.openai.chat.completions.create(messages=MESSAGES, **kw)
    stream = gw.openai.chat.completions.create(messages=MESSAGES, stream=True,
                                               stream_options={"include_usage": True}, **kw)
    texts, finishes, usages, ids = {0: "", 1: "", 2: ""}, {}, [], set()
    for event in stream:
        ids.add(event.id)
        if event.usage is not None:
            usages.append(event.usage)
        for c in event.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                assert c.index not in finishes, "a choice ended twice"
                finishes[c.index] = c.finish_reason
    assert len(ids) == 1, "one response id for all choices"
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert len(set(texts.values())) > 1, "different seeds, different samples"
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert len(usages) == 1 and usages[0].completion_tokens == 30
    assert usages[0].prompt_tokens == whole.usage.prompt_tokens
    # completions, greedy: three equal choices, each the plain greedy reply
    ctx = apply_chat_template(tiny_loaded.tokenizer, MESSAGES)
    expected = tiny_loaded.tokenizer.decode(
        Engine(tiny_loaded).generate(ctx, SamplingParams(max_new_tokens=10, ignore_eos=True),
                                     SpecConfig(strategy=DraftStrategy.none)).token_ids, skip_special_tokens=True)
    got = {0: "", 1: "", 2: ""}
    for event in gw.openai.completions.create(model="tiny", prompt=ctx, max_tokens=10, temperature=0, n=3,
                                              stream=True, extra_body=extra):
        for c in event.choices:
            got[c.index] += c.text
    assert got == {0: expected, 1: expected, 2: expected}


def test_n_choices_over_grpc(chain, tiny_loaded):
    """GenerateRequest.n = 3 seeded: the messages name their choice, each choice's tokens are the
    in-process sampling with seed + i, each ends once; n with a session or above 8 is refused."""
    gw, _ = chain
    ctx = apply_chat_template(tiny_loaded.tokenizer, MESSAGES)
    sampling = common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=21)
    msgs = list(gw.stub.Generate(gateway_pb2.GenerateRequest(
        prompt=tiny_loaded.tokenizer.decode(ctx), sampling=sampling, n=3), timeout=60))
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    ends: dict[int, int] = {}
    for m in msgs:
        assert m.first_index == len(tokens[m.choice]), "each choice's messages in order"
        tokens[m.choice] += list(m.token_ids)
        if m.finish_reason:
            ends[m.choice] = ends.get(m.choice, 0) + 1
    assert ends == {0: 1, 1: 1, 2: 1}
    prompt_ids = tiny_loaded.tokenizer(tiny_loaded.tokenizer.decode(ctx), add_special_tokens=False)["input_ids"]
    engine = Engine(tiny_loaded)
    for i in range(3):
        expected = engine.generate(prompt_ids, SamplingParams(temperature=0.8, seed=21 + i, max_new_tokens=8, ignore_eos=True),
                                   SpecConfig(strategy=DraftStrategy.none)).token_ids
        assert tokens[i] == expected, i
    for bad, words in ((dict(n=2, session_id="s"), "session"), (dict(n=9), "n must be 1 to 8")):
        with pytest.raises(grpc.RpcError) as err:
            list(gw.stub.Generate(gateway_pb2.GenerateRequest(prompt="x", **bad), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


def _cut_after(verifiers, steps: int) -> dict:
    """Make whichever verifier serves the next request drain and cut its stream after `steps`
    verification steps (the real drain path: VerifierCore.drain + cut, UNAVAILABLE mid-stream),
    once. Returns a dict that names the verifier that was cut."""
    cut = {"verifier": None}
    for v in verifiers:
        core = v.core
        observe, count = core._observe, {"n": 0}

        def hooked(span, step, proposer, faults, batch, core=core, observe=observe, count=count):
            observe(span, step, proposer, faults, batch)
            count["n"] += 1
            if count["n"] == steps and cut["verifier"] is None:
                cut["verifier"] = core.settings.verifier_id
                core.drain()
                core.cut()

        core._observe = hooked
    return cut


@pytest.mark.parametrize("strategy", [common_pb2.DRAFT_STRATEGY_NONE, common_pb2.DRAFT_STRATEGY_MODEL])
def test_a_stream_cut_midway_continues_on_the_other_verifier_unchanged(chain, tiny_loaded, strategy):
    """Failover mid-stream: the serving verifier drains and cuts the stream after a few steps; the
    gateway continues it on the other verifier from what streamed. The client sees one stream:
    every index once, in order, and the tokens of the target alone."""
    gw, verifiers = chain
    cut = _cut_after(verifiers, 3)
    tokens, last = _grpc_generate(gw, strategy, max_new=40)
    assert cut["verifier"] is not None and last.verifier_id != cut["verifier"]
    assert last.resumed == 1 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert tokens == _reference(tiny_loaded, 40)
    assert gw.core.stats.resumed == 1
    # The drained verifier takes no new request; the next one goes to the other directly.
    tokens2, last2 = _grpc_generate(gw, strategy, max_new=8)
    assert last2.verifier_id != cut["verifier"] and last2.resumed == 0


def test_a_cut_stream_waits_for_a_verifier_that_comes_up_and_continues_there(chain, tiny_loaded, redis_url):
    """A rolling update: the only verifier left drains and cuts its stream, and its replacement
    registers a moment later (a port the gateway has never seen, known only through Redis). The
    gateway holds the stream, polls for the replacement and continues there; the client sees one
    stream with the target's tokens."""
    gw, verifiers = chain
    verifiers[1].stop()  # deregistered: the one verifier left is v0
    gw.core._static.pop(verifiers[1].address)
    replacement = []
    cut = _cut_after(verifiers[:1], 3)
    observe = verifiers[0].core._observe

    def cut_then_replace(*args):
        observe(*args)
        if cut["verifier"] is not None and not replacement:
            replacement.append(None)  # once
            threading.Timer(1.5, lambda: replacement.__setitem__(
                0, RealVerifier("v2", tiny_loaded, redis_url, drafters=verifiers[0].core.settings.drafters))).start()

    verifiers[0].core._observe = cut_then_replace
    try:
        tokens, last = _grpc_generate(gw, common_pb2.DRAFT_STRATEGY_NONE, max_new=40)
        assert cut["verifier"] == "v0" and last.verifier_id == "v2" and last.resumed == 1
        assert tokens == _reference(tiny_loaded, 40)
    finally:
        deadline = time.monotonic() + 10
        while replacement and replacement[0] is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if replacement and replacement[0] is not None:
            replacement[0].stop()


def test_a_cut_stream_with_no_verifier_to_take_it_fails_in_words_after_the_wait(tiny_loaded, redis_url):
    """No verifier comes: after resume_wait_s the client gets ABORTED saying what streamed, that
    the stream is incomplete and which verifier drained; not a silent end, not a hang."""
    redis.Redis.from_url(redis_url).flushdb()
    v = RealVerifier("v0", tiny_loaded, redis_url)
    gw = Gateway(tiny_loaded.tokenizer, model="tiny", redis_url=redis_url, verifiers=(v.address,),
                 poll_interval_s=0.5, resume_wait_s=1.0)
    try:
        time.sleep(0.6)
        cut = _cut_after([v], 3)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            _grpc_generate(gw, common_pb2.DRAFT_STRATEGY_NONE, max_new=40)
        assert cut["verifier"] == "v0"
        assert err.value.code() == grpc.StatusCode.ABORTED
        details = err.value.details()
        assert "incomplete" in details and "no other verifier could continue it" in details
        assert "v0" in details and "127.0.0.1" not in details  # ids, never addresses
        assert time.monotonic() - start >= 1.0, "it gave up before its wait"
    finally:
        gw.close()
        v.stop()


def test_a_resumed_stream_counts_its_earlier_tokens_for_the_penalties(chain, tiny_loaded):
    """The continuation of a cut stream is the one an uninterrupted request makes: the penalties see
    the tokens streamed before the failover as output (resumed_tokens), not as prompt."""
    gw, verifiers = chain
    sampling = dict(max_new_tokens=32, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7)
    ctx = apply_chat_template(tiny_loaded.tokenizer, MESSAGES)
    expected = Engine(tiny_loaded).generate(ctx, SamplingParams(**sampling), SpecConfig(strategy=DraftStrategy.none))
    # What a continuation that took the streamed tokens for prompt would give (the bug this guards):
    head = expected.token_ids[:6]
    wrong = Engine(tiny_loaded).generate(ctx + head, SamplingParams(**{**sampling, "max_new_tokens": 26}),
                                         SpecConfig(strategy=DraftStrategy.none)).token_ids
    assert head + wrong != expected.token_ids, "the test must be able to tell the two apart"
    cut = _cut_after(verifiers, 6)  # plain steps: one token each, so 6 tokens streamed before the cut
    req = gateway_pb2.GenerateRequest(
        prompt_ids=gateway_pb2.TokenIds(ids=ctx), sampling=common_pb2.SamplingParams(**sampling),
        speculation=common_pb2.SpeculationParams(strategy=common_pb2.DRAFT_STRATEGY_NONE))
    tokens, last = [], None
    for msg in gw.stub.Generate(req, timeout=30):
        assert msg.first_index == len(tokens) or not msg.token_ids
        tokens.extend(msg.token_ids)
        last = msg
    assert cut["verifier"] is not None and last.resumed == 1
    assert tokens == expected.token_ids
