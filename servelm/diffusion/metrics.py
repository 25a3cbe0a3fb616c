"""Prometheus metrics of the diffusion server: its own registry and families (no LLM token metrics).

Names use the `servelm:` prefix of `servelm.metrics`, with vLLM/SGLang's names where one exists.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servelm.metrics import PREFIX

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64)


class DiffusionMetrics:
    """Requests, queue depth, images, seconds per denoising step, batch sizes, end-to-end latency."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = m = model_name
        labels = ["model_name"]

        def family(kind: type, name: str, doc: str, extra: tuple[str, ...] = (), **kw: object) -> object:
            return kind(f"{PREFIX}:{name}", doc, [*labels, *extra], registry=self.registry, **kw)

        self.requests = family(Counter, "num_requests", "Finished image requests, by outcome.", ("outcome",))
        self.rejected = family(Counter, "num_rejected_requests", "Requests refused with 429 (queue full).").labels(m)
        self.waiting = family(Gauge, "num_requests_waiting", "Requests waiting in the queue.").labels(m)
        self.running = family(Gauge, "num_requests_running", "Requests in the batch being denoised.").labels(m)
        self.images = family(Counter, "images_generated", "Images generated and returned.").labels(m)
        self.step = family(Histogram, "denoising_step_seconds", "Seconds per denoising step of a batch.",
                           buckets=_SECONDS).labels(m)
        self.batch = family(Histogram, "batch_size_images", "Images denoised together per pipeline call.",
                            buckets=_BATCH).labels(m)
        self.e2e = family(Histogram, "e2e_request_latency_seconds", "Time from request arrival to its images.",
                          buckets=_SECONDS).labels(m)

    def finished(self, outcome: str, seconds: float, images: int = 0) -> None:
        self.requests.labels(self.model_name, outcome).inc()
        if outcome == "ok":
            self.e2e.observe(seconds)
            self.images.inc(images)

    def render(self) -> bytes:
        return generate_latest(self.registry)
