"""Prometheus metrics of the HTTP server (prometheus-client).

Names follow vLLM/SGLang (`<prefix>:<name>`) so existing dashboards need only
the prefix changed. Latencies and token counts are observed in the API
process as outputs arrive; a request's queue/prefill/decode times come with
its final output, measured by the scheduler; tokens per step and preemptions
(retractions) come with the scheduler's output messages
(`BatchTokenOut.iteration_tokens`, `num_preemptions`); scheduler-side state
(running/queued requests, KV usage, cache hit rate) is pulled from the
scheduler when `/metrics` is scraped, so it is never stale.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

PREFIX = "servelm"
# No `*_created` series (one timestamp per counter and histogram, which dashboards never use; vLLM drops
# them too). A process-wide switch of prometheus-client: this module is what exports in this process.
disable_created_metrics()

# vLLM's buckets of iteration_tokens_total (its CUDA-graph batch sizes and up).
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's 1-2-5 buckets of per-request token counts (it stops them at max_model_len; these go on, fixed, since
# the registry exists before the model is loaded).
_TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
_N_BUCKETS = (1, 2, 5, 10, 20)
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    """Every metric the server exports, in its own registry (one per server instance)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, dp_size: int = 1) -> None:
        self.registry = CollectorRegistry()
        # With data-parallel replicas every family but the API's own rejections has a dp_rank label too.
        labels = ["model_name", "dp_rank"] if dp_size > 1 else ["model_name"]
        self.model_name = model_name
        self.dp_size = dp_size

        families: list[tuple[Any, tuple[str, ...]]] = []  # (family, its labels after model_name and dp_rank)

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            families.append((Histogram(f"{PREFIX}:{name}", doc, labels, buckets=buckets, registry=self.registry), ()))
            return families[-1][0]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            families.append((Counter(f"{PREFIX}:{name}", doc, [*labels, *extra], registry=self.registry), extra))
            return families[-1][0]

        def gauge(name: str, doc: str, prefix: str = PREFIX) -> Gauge:
            families.append((Gauge(f"{prefix}:{name}", doc, labels, registry=self.registry), ()))
            return families[-1][0]

        def tokens_hist(name: str, doc: str, buckets: tuple[float, ...] = _TOKEN_COUNT_BUCKETS) -> Histogram:
            return hist(name, doc, buckets)

        self.ttft = hist("time_to_first_token_seconds", "Time from request arrival to its first output token.")
        self.itl = hist("inter_token_latency_seconds", "Time between two consecutive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from request arrival to its last output token.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.requests = counter("num_requests", "Finished requests, by finish reason.", ("finish_reason",))
        self.aborted = counter("num_aborted_requests", "Requests aborted (client hang-up or /abort_request).")
        self.rejected = Counter(f"{PREFIX}:num_rejected_requests", "Requests refused with 429 (queue full).",
                                ["model_name"], registry=self.registry)
        self.running = gauge("num_requests_running", "Requests in the scheduler's running batch.")
        self.queued = gauge("num_requests_waiting", "Requests waiting in the scheduler's queue.")
        self.kv_used_tokens = gauge("kv_used_tokens", "KV cache tokens held by running requests.")
        self.kv_cached_tokens = gauge("kv_cached_tokens", "KV cache tokens held by the prefix cache.")
        self.kv_total_tokens = gauge("kv_total_tokens", "KV cache capacity in tokens.")
        self.kv_usage = gauge("token_usage", "Fraction of KV cache tokens in use (0..1).")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prefix cache hit rate (0..1).")
        # vLLM's families (same names under our prefix).
        self.kv_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent (prefix-cached "
                                   "tokens are evictable and count as free).")
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens per scheduler step, as vLLM counts them: the "
                                     "whole prompt (cached or not) of each request whose prefill ends in the step, "
                                     "plus the tokens it generates.", _STEP_TOKEN_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Per request: decode time / (output tokens - 1).")
        self.queue_time = hist("request_queue_time_seconds", "Time a request waited in the scheduler's queue.")
        self.prefill_time = hist("request_prefill_time_seconds", "Time from a request's admission to its first "
                                 "token.")
        self.decode_time = hist("request_decode_time_seconds", "Time from a request's first to its last token.")
        self.preemptions = counter("num_preemptions", "Requests retracted (preempted) because the KV cache was "
                                   "full.")
        # vLLM's per-request families.
        self.request_success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self.request_prompt_tokens = tokens_hist("request_prompt_tokens", "Prompt tokens of each finished request.")
        self.request_generation_tokens = tokens_hist("request_generation_tokens",
                                                     "Generated tokens of each finished request.")
        self.request_params_n = tokens_hist("request_params_n", "The n (choices) of each finished API request.",
                                            _N_BUCKETS)
        self.request_params_max_tokens = tokens_hist("request_params_max_tokens",
                                                     "The max_tokens of each finished request.")
        self.inference_time = hist("request_inference_time_seconds", "Time a request spent running: prefill and "
                                   "decode (its queue time left out).")
        # Prefix cache, in tokens: each finished request's prompt is a query, its cached tokens the hits. vLLM 0.x
        # named them gpu_prefix_cache_*, and its KV usage gpu_cache_usage_perc: both names are exported.
        self.prefix_queries = [counter(n, "Prompt tokens looked up in the prefix cache.")
                               for n in ("prefix_cache_queries", "gpu_prefix_cache_queries")]
        self.prefix_hits = [counter(n, "Prompt tokens found in the prefix cache.")
                            for n in ("prefix_cache_hits", "gpu_prefix_cache_hits")]
        self.gpu_cache_usage = gauge("gpu_cache_usage_perc", "KV cache usage (vLLM 0.x's name of "
                                     "kv_cache_usage_perc; the cache is in RAM on a CPU).")
        # Speculative decoding (vLLM's spec_decode_* families), from the scheduler's running totals.
        self.spec_counters = [
            (counter("spec_decode_num_drafts", "Verify steps with a draft (one per speculating request and step)."),
             "spec_decode_num_drafts"),
            (counter("spec_decode_num_draft_tokens", "Draft tokens proposed."), "spec_decode_num_draft_tokens"),
            (counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."), "spec_decode_num_accepted_tokens"),
        ]
        self.spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their "
                                    "position in the draft (0 = first).", ("position",))
        self._spec_seen: dict[str, int] = {}
        self._cache_config_registered = False
        # vLLM's names of the three load gauges, which SMG's load monitor reads from a worker it takes for vLLM
        # (it does so for servelm, which answers /version): so a router in front balances on real loads.
        self.vllm_running = gauge("num_requests_running", "Requests running (vLLM's name, for routers).", "vllm")
        self.vllm_waiting = gauge("num_requests_waiting", "Requests waiting (vLLM's name, for routers).", "vllm")
        self.vllm_kv_usage = gauge("kv_cache_usage_perc", "KV cache usage, 1 = full (vLLM's name, for routers).",
                                   "vllm")
        # Every family has a sample from the start (zero), as vLLM's: a family with no sample yet has no labels
        # either, and a router that merges several workers' /metrics (sgl-router's /engine_metrics) refuses the mix.
        for rank in range(dp_size):
            values = self._labels(rank)
            for collector, extra in families:
                if not extra:
                    collector.labels(*values)
                elif extra in (("finish_reason",), ("finished_reason",)):
                    for reason in ("stop", "length", "abort"):
                        collector.labels(*values, reason)
                elif extra == ("position",):
                    collector.labels(*values, "0")
        self.rejected.labels(model_name)

    def _labels(self, dp_rank: int = 0) -> tuple[str, ...]:
        """The label values of a family's child: the model, and the replica under --dp-size."""
        return (self.model_name, str(dp_rank)) if self.dp_size > 1 else (self.model_name,)

    def observe_first_token(self, seconds: float, dp_rank: int = 0) -> None:
        self.ttft.labels(*self._labels(dp_rank)).observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int, dp_rank: int = 0) -> None:
        """A step that produced `num_tokens` tokens after `seconds`: one ITL sample per token."""
        per_token = seconds / max(num_tokens, 1)
        child = self.itl.labels(*self._labels(dp_rank))
        for _ in range(max(num_tokens, 1)):
            child.observe(per_token)

    def observe_generated(self, num_tokens: int, dp_rank: int = 0) -> None:
        if num_tokens:
            self.generation_tokens.labels(*self._labels(dp_rank)).inc(num_tokens)

    def observe_finished(self, finish_type: str, e2e_seconds: float, prompt_tokens: int,
                         cached_tokens: int, completion_tokens: int = 0, max_tokens: int | None = None,
                         dp_rank: int = 0) -> None:
        m = self._labels(dp_rank)
        self.e2e.labels(*m).observe(e2e_seconds)
        self.prompt_tokens.labels(*m).inc(prompt_tokens)
        self.cached_tokens.labels(*m).inc(cached_tokens)
        self.requests.labels(*m, finish_type).inc()
        if finish_type == "abort":
            self.aborted.labels(*m).inc()
        self.request_success.labels(*m, finish_type).inc()
        self.request_prompt_tokens.labels(*m).observe(prompt_tokens)
        self.request_generation_tokens.labels(*m).observe(completion_tokens)
        if max_tokens is not None:
            self.request_params_max_tokens.labels(*m).observe(max_tokens)
        for queries, hits in zip(self.prefix_queries, self.prefix_hits, strict=True):
            queries.labels(*m).inc(prompt_tokens)
            hits.labels(*m).inc(cached_tokens)

    def observe_request_n(self, n: int, dp_rank: int = 0) -> None:
        """An API request's n (its choices), once all of them finished."""
        self.request_params_n.labels(*self._labels(dp_rank)).observe(n)

    def set_cache_config(self, labels: dict[str, Any]) -> None:
        """vLLM's cache_config_info: one sample of value 1 whose labels are the KV cache's configuration."""
        if self._cache_config_registered:
            return
        names = sorted(labels)
        info = Gauge(f"{PREFIX}:cache_config_info", "Information of the KV cache configuration.", names,
                     registry=self.registry)
        info.labels(*(str(labels[k]) for k in names)).set(1)
        self._cache_config_registered = True

    def observe_request_times(self, timings: dict[str, float] | None, completion_tokens: int,
                              dp_rank: int = 0) -> None:
        """A finished request's phases as the scheduler measured them (`TokenOut.timings`)."""
        if not timings:
            return
        m = self._labels(dp_rank)
        for hist, key in ((self.queue_time, "queue"), (self.prefill_time, "prefill"), (self.decode_time, "decode")):
            if key in timings:
                hist.labels(*m).observe(timings[key])
        if "prefill" in timings:
            self.inference_time.labels(*m).observe(timings["prefill"] + timings.get("decode", 0.0))
        if "decode" in timings and completion_tokens > 1:
            self.tpot.labels(*m).observe(timings["decode"] / (completion_tokens - 1))

    def observe_steps(self, step_tokens: list[int], preemptions: int, dp_rank: int = 0) -> None:
        """Scheduler steps (tokens each ran) and retractions since its last message."""
        child = self.iteration_tokens.labels(*self._labels(dp_rank))
        for tokens in step_tokens:
            child.observe(tokens)
        if preemptions > 0:
            self.preemptions.labels(*self._labels(dp_rank)).inc(preemptions)

    def observe_aborted(self, dp_rank: int = 0) -> None:
        """A request the API aborted itself (client hang-up), whose final output it no longer waits for."""
        self.requests.labels(*self._labels(dp_rank), "abort").inc()
        self.aborted.labels(*self._labels(dp_rank)).inc()
        self.request_success.labels(*self._labels(dp_rank), "abort").inc()

    def observe_rejected(self) -> None:
        self.rejected.labels(self.model_name).inc()

    def update_scheduler_state(self, info: dict[str, Any], dp_rank: int = 0) -> None:
        """Set the gauges from the scheduler's `server_info()` dict (missing keys are skipped)."""
        m = self._labels(dp_rank)
        pairs = [(self.running, "num_running"), (self.queued, "num_waiting"),
                 (self.kv_used_tokens, "kv_in_use_tokens"), (self.kv_cached_tokens, "kv_cached_tokens"),
                 (self.kv_total_tokens, "kv_total_tokens"), (self.cache_hit_rate, "cache_hit_rate")]
        pairs += [(self.vllm_running, "num_running"), (self.vllm_waiting, "num_waiting")]
        for gauge, key in pairs:
            value = info.get(key)
            if isinstance(value, (int, float)):
                gauge.labels(*m).set(value)
        for counter, key in self.spec_counters:  # counters: add what the totals grew by since the last call
            self._inc_to(counter.labels(*m), f"{key}@{dp_rank}", info.get(key))
        for pos, value in enumerate(info.get("spec_decode_num_accepted_tokens_per_pos") or []):
            self._inc_to(self.spec_per_pos.labels(*m, str(pos)), f"per_pos_{pos}@{dp_rank}", value)
        total, in_use = info.get("kv_total_tokens"), info.get("kv_in_use_tokens")
        if isinstance(total, (int, float)) and total > 0 and isinstance(in_use, (int, float)):
            # Prefix-cached tokens are evictable, so only tokens held by requests count as used.
            self.kv_usage.labels(*m).set(in_use / total)
            self.kv_usage_perc.labels(*m).set(in_use / total)
            self.gpu_cache_usage.labels(*m).set(in_use / total)
            self.vllm_kv_usage.labels(*m).set(in_use / total)

    def update_from_server_info(self, info: dict[str, Any]) -> None:
        """The gauges from /server_info's dict: one replica's, or under --dp-size each replica's own."""
        replicas = info.get("replicas")
        if self.dp_size > 1 and isinstance(replicas, list):
            for rep in replicas:
                if isinstance(rep, dict) and rep.get("alive"):
                    self.update_scheduler_state(rep, int(rep.get("dp_rank", 0)))
        else:
            self.update_scheduler_state(info)

    def forget_replica(self, dp_rank: int) -> None:
        """A replica restarted: its running totals start from zero again."""
        self._spec_seen = {k: v for k, v in self._spec_seen.items() if not k.endswith(f"@{dp_rank}")}

    def _inc_to(self, child: Any, key: str, total: Any) -> None:
        if isinstance(total, int) and total > self._spec_seen.get(key, 0):
            child.inc(total - self._spec_seen.get(key, 0))
            self._spec_seen[key] = total

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
