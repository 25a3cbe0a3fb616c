"""The vLLM metric families without a server (issue 15, item 6): how the scheduler process batches its step
statistics onto its messages, what the scheduler measures per request, and what the API process exports.
The end-to-end check over HTTP is tests/entrypoints/test_endpoints_parity.py::test_vllm_metric_families."""

from __future__ import annotations

import re
from typing import Any

import pytest

from servelm.managers import scheduler_process
from servelm.managers.io_struct import BatchTokenOut, FinishReason, TokenOut, decode, encode
from servelm.managers.scheduler_process import SchedulerLoop
from servelm.metrics import ServerMetrics


class Sink:
    """A socket stand-in that keeps what was sent."""

    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def send(self, raw: bytes) -> None:
        self.msgs.append(decode(raw))


class Stepping:
    """A scheduler stand-in: every step runs `tokens` tokens; outputs and retractions on demand."""

    def __init__(self) -> None:
        self.stats = {"retractions": 0}
        self.last_step_tokens = 0
        self.outputs: list[TokenOut] = []

    def has_work(self) -> bool:
        return True

    def step(self) -> list[TokenOut]:
        self.last_step_tokens = 3
        outs, self.outputs = self.outputs, []
        return outs


def loop_over(sched: Stepping, sink: Sink) -> SchedulerLoop:
    loop = SchedulerLoop(sched, recv=None, send=sink, stats_interval_s=3600)  # type: ignore[arg-type]
    loop._receive = lambda block: []  # type: ignore[method-assign]
    return loop


def test_step_stats_ride_on_outputs_or_go_alone_when_due(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_process, "STEP_STATS_MAX_AGE_S", 3600.0)
    sched, sink = Stepping(), Sink()
    loop = loop_over(sched, sink)
    for _ in range(5):
        loop.run_once()
    assert sink.msgs == []  # no outputs and not due yet: nothing sent
    sched.stats["retractions"] = 2
    sched.outputs = [TokenOut("r", [1], "a", None, 1, 1, 0)]
    loop.run_once()
    (msg,) = sink.msgs
    assert isinstance(msg, BatchTokenOut) and msg.iteration_tokens == [3] * 6 and msg.num_preemptions == 2
    assert [o.rid for o in msg.outputs] == ["r"]
    for _ in range(scheduler_process.STEP_STATS_MAX_STEPS):
        loop.run_once()
    assert len(sink.msgs) == 2 and sink.msgs[1].outputs == [] and sink.msgs[1].num_preemptions == 0
    assert len(sink.msgs[1].iteration_tokens) == scheduler_process.STEP_STATS_MAX_STEPS


def test_batch_token_out_round_trips_its_stats() -> None:
    out = TokenOut("r", [1], "a", FinishReason.length(), 1, 1, 0, label_logprobs=[-1.5],
                   timings={"queue": 0.1, "prefill": 0.2, "decode": 0.3})
    back = decode(encode(BatchTokenOut([out], iteration_tokens=[4, 1], num_preemptions=1)))
    assert back.iteration_tokens == [4, 1] and back.num_preemptions == 1
    assert back.outputs[0].timings == out.timings and back.outputs[0].label_logprobs == [-1.5]


def sample(text: str, name: str) -> float:
    match = re.search(rf'^servelm:{re.escape(name)}\{{model_name="m"[^}}]*\}} (\S+)$', text, re.M)
    assert match, name
    return float(match.group(1))


def test_exported_families() -> None:
    metrics = ServerMetrics("m")
    metrics.observe_request_times({"queue": 0.5, "prefill": 0.25, "decode": 2.0}, completion_tokens=5)
    metrics.observe_request_times({"queue": 0.1}, completion_tokens=0)  # aborted while queued
    metrics.observe_steps([512, 1, 1], preemptions=2)
    metrics.update_scheduler_state({"kv_total_tokens": 1000, "kv_in_use_tokens": 250})
    text = metrics.render().decode()
    assert sample(text, "request_queue_time_seconds_count") == 2
    assert sample(text, "request_queue_time_seconds_sum") == pytest.approx(0.6)
    assert sample(text, "request_prefill_time_seconds_sum") == 0.25
    assert sample(text, "request_decode_time_seconds_sum") == 2.0
    assert sample(text, "time_per_output_token_seconds_sum") == 0.5  # 2.0 s over the 4 tokens after the first
    assert sample(text, "iteration_tokens_total_count") == 3 and sample(text, "iteration_tokens_total_sum") == 514
    assert 'servelm:iteration_tokens_total_bucket{le="1.0",model_name="m"} 2.0' in text
    assert sample(text, "num_preemptions_total") == 2
    assert sample(text, "kv_cache_usage_perc") == 0.25 and sample(text, "gpu_cache_usage_perc") == 0.25
    # request_inference_time_seconds: prefill + decode, the queue left out (the aborted one never ran)
    assert sample(text, "request_inference_time_seconds_count") == 1
    assert sample(text, "request_inference_time_seconds_sum") == 2.25


def test_vllm_request_families() -> None:
    metrics = ServerMetrics("m")
    metrics.observe_finished("stop", 1.0, prompt_tokens=30, cached_tokens=20, completion_tokens=7, max_tokens=16)
    metrics.observe_finished("length", 1.0, prompt_tokens=5, cached_tokens=0, completion_tokens=16, max_tokens=16)
    metrics.observe_aborted()
    metrics.observe_request_n(2)
    metrics.set_cache_config({"block_size": 1, "cache_dtype": "bfloat16", "enable_prefix_caching": True,
                              "num_gpu_blocks": 4096, "num_cpu_blocks": None})
    metrics.set_cache_config({"block_size": 99})  # once only
    text = metrics.render().decode()
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1)):
        assert f'servelm:request_success_total{{finished_reason="{reason}",model_name="m"}} {count}.0' in text
    assert sample(text, "request_prompt_tokens_sum") == 35 and sample(text, "request_prompt_tokens_count") == 2
    assert 'servelm:request_prompt_tokens_bucket{le="5.0",model_name="m"} 1.0' in text
    assert sample(text, "request_generation_tokens_sum") == 23
    assert sample(text, "request_params_max_tokens_sum") == 32
    assert sample(text, "request_params_n_sum") == 2
    assert 'servelm:request_params_n_bucket{le="2.0",model_name="m"} 1.0' in text
    for prefix in ("", "gpu_"):
        assert sample(text, f"{prefix}prefix_cache_queries_total") == 35
        assert sample(text, f"{prefix}prefix_cache_hits_total") == 20
    assert ('servelm:cache_config_info{block_size="1",cache_dtype="bfloat16",enable_prefix_caching="True",'
            'num_cpu_blocks="None",num_gpu_blocks="4096"} 1.0') in text
    assert "block_size=\"99\"" not in text and 'block_size="99"' not in text


def run_to_end(sched: Any) -> list[TokenOut]:
    outs: list[TokenOut] = []
    while sched.has_work():
        outs += sched.step()
    return outs


def test_scheduler_scores_label_tokens_after_a_chunked_prompt() -> None:
    """/v1/score's scheduler half: label rows only in the step that completes the prompt, nothing generated."""
    from servelm.managers.io_struct import GenerateReq
    from tests.managers.test_scheduler import make, next_token

    sched = make(chunked_prefill_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    right, wrong = next_token(prompt), next_token(prompt) % 60 + 2
    sched.add_request(GenerateReq("s", prompt, {"max_new_tokens": 0}, label_token_ids=[right, wrong]))
    (out,) = run_to_end(sched)
    assert out.token_ids == [] and out.finish_reason == FinishReason.length()
    assert out.label_logprobs is not None and len(out.label_logprobs) == 2
    assert out.label_logprobs[0] == pytest.approx(0.0, abs=1e-6) and out.label_logprobs[1] < -15
    assert set(out.timings or {}) == {"queue", "prefill"}


def test_iteration_tokens_count_the_whole_prompt_once_cached_or_not() -> None:
    """vLLM's iteration_tokens_total: a prefill chunk that does not end the prompt counts nothing, the step
    that ends it the whole prompt (its cached prefix too) plus the token it samples, a decode one token."""
    from servelm.managers.io_struct import GenerateReq
    from tests.managers.test_scheduler import make

    sched = make(chunked_prefill_size=4)
    prompt = list(range(5, 15))
    sched.add_request(GenerateReq("a", prompt, {"max_new_tokens": 2, "ignore_eos": True}))
    counts = []
    while sched.has_work():
        sched.step()
        counts.append(sched.last_step_tokens)
    assert counts == [0, 0, 11, 1]  # chunks of 4, 4, 2, then one decode
    sched.add_request(GenerateReq("b", prompt + [42], {"max_new_tokens": 1}))  # 10 of its 11 tokens cached
    sched.step()
    assert sched.last_step_tokens == 12 and not sched.has_work()
    sched.add_request(GenerateReq("c", prompt, {"max_new_tokens": 0}))  # prefill only: the prompt alone
    sched.step()
    assert sched.last_step_tokens == 10


def test_scheduler_times_each_phase_and_counts_steps() -> None:
    from servelm.managers.io_struct import GenerateReq
    from tests.managers.test_scheduler import make

    sched = make()
    sched.add_request(GenerateReq("g", [1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True}))
    sched.step()
    assert sched.last_step_tokens == 4  # the prompt and its first token, as vLLM counts
    outs = run_to_end(sched)
    assert sched.last_step_tokens == 1 and outs[-1].label_logprobs is None  # a decode step
    timings = outs[-1].timings or {}
    assert set(timings) == {"queue", "prefill", "decode"} and all(v >= 0 for v in timings.values())
