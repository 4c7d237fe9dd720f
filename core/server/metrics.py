"""Prometheus metrics of one server app, in a registry of its own (apps and tests stay apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: sub-millisecond CPU steps up to queueing under heavy load.
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536, 262144)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    """Requests by endpoint and status and their end-to-end duration; requests per LoRA adapter;
    per-input queue and
    inference time; tokens per request; requests per engine step (batch size); inputs running
    and waiting; per-token output values in flight and requests waiting for room for theirs.
    Implements the engine loop's observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("poolrunner_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.request_duration = Histogram(
            "poolrunner_http_request_duration_seconds",
            "Seconds from a request's arrival to the end of its answer, by endpoint",
            ["endpoint"], buckets=TIME_BUCKETS, registry=self.registry,
        )
        self.queue_time = Histogram("poolrunner_queue_time_seconds", "Seconds an input waited for its first step",
                                    buckets=TIME_BUCKETS, registry=self.registry)
        self.inference_time = Histogram("poolrunner_inference_time_seconds",
                                        "Seconds from an input's first step to its result",
                                        buckets=TIME_BUCKETS, registry=self.registry)
        self.request_tokens = Histogram("poolrunner_request_prompt_tokens", "Prompt tokens of one HTTP request",
                                        buckets=TOKEN_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("poolrunner_batch_size", "Requests (inputs) run together in one engine step",
                                    buckets=BATCH_BUCKETS, registry=self.registry)
        self.batch_tokens = Histogram("poolrunner_batch_tokens", "Tokens run in one engine step",
                                      buckets=TOKEN_BUCKETS, registry=self.registry)
        self.lora_requests = Counter("poolrunner_lora_requests", "HTTP requests answered with a LoRA adapter, by "
                                     "adapter", ["lora"], registry=self.registry)
        self.in_flight = Gauge("poolrunner_http_requests_in_flight", "HTTP requests being answered",
                               registry=self.registry)
        self.pending = Gauge("poolrunner_pending_requests", "Inputs queued or running in the engine",
                             registry=self.registry)
        # vLLM's split of the pending inputs (vllm:num_requests_running / _waiting).
        self.running = Gauge("poolrunner_num_requests_running", "Inputs some engine step has started, not finished",
                             registry=self.registry)
        self.waiting = Gauge("poolrunner_num_requests_waiting", "Inputs no engine step has started yet",
                             registry=self.registry)
        self.output_values = Gauge("poolrunner_output_values_in_flight",
                                   "Per-token output values held by requests, from admission until sent",
                                   registry=self.registry)
        self.output_waiting = Gauge("poolrunner_output_budget_waiting",
                                    "Requests with per-token outputs waiting for room in the output budget",
                                    registry=self.registry)

    def on_step(self, num_reqs: int, num_tokens: int) -> None:
        self.batch_size.observe(num_reqs)
        self.batch_tokens.observe(num_tokens)

    def on_finish(self, queue_time: float, inference_time: float) -> None:
        self.queue_time.observe(queue_time)
        self.inference_time.observe(inference_time)

    def render(self) -> bytes:
        """The text exposition format (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)
