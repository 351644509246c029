"""Prometheus metrics of the server, in a registry of its own.

Not the global ``REGISTRY``: every app gets its own ``CollectorRegistry``, so tests (and an
embedding program) can build several apps in one process without duplicate-name errors.
Gauges of the engine (queue depth, active slots) are read from ``Engine.stats()`` when
``/metrics`` is scraped, so they are never stale. ``prometheus_client`` is imported when a
``Metrics`` is made: it is part of the optional ``[serve]`` extra, kept out of
``import aotlm`` and out of the other commands' start-up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

PREFIX = "aotlm_"
_COMPILES = {"n": 0, "listening": False}
_COMPILES_LOCK = threading.Lock()


def count_compilations() -> None:
    """Count XLA compilations in this process from now on (``compilations()``); idempotent."""
    import jax  # local: only a server counts

    with _COMPILES_LOCK:
        if _COMPILES["listening"]:
            return
        _COMPILES["listening"] = True

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILES["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)


def compilations() -> int:
    """XLA compilations since ``count_compilations`` was first called."""
    return _COMPILES["n"]


# latency buckets (seconds) from a tiny CPU model's milliseconds to a large model's seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The server's counters, gauges and histograms, and their text exposition."""

    def __init__(self) -> None:
        # local: optional [serve] extra, kept out of `import aotlm` and other commands
        import prometheus_client as pc

        self._latest, self.content_type = pc.generate_latest, pc.CONTENT_TYPE_LATEST
        r = self.registry = pc.CollectorRegistry()
        self.queue_depth = pc.Gauge(PREFIX + "queue_depth", "Requests waiting for a slot", registry=r)
        self.active_slots = pc.Gauge(PREFIX + "active_slots", "Slots generating now", registry=r)
        self.slots = pc.Gauge(PREFIX + "slots", "Slots of the compiled batch", registry=r)
        self.prompt_tokens = pc.Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = pc.Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = pc.Counter(
            PREFIX + "prompt_tokens_cached", "Prompt tokens whose K/V was reused (prefix reuse)", registry=r
        )
        gauge = lambda name, what: pc.Gauge(PREFIX + name, what, registry=r)
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Admitted requests that reused a prefix")
        self.prefix_reuse = gauge("prefix_cache_token_rate", "Share of admitted prompt tokens reused")
        self.held_rows = gauge("prefix_cache_rows", "Free rows holding a reusable prefix")
        self.store_bytes = gauge("prefix_store_bytes", "Bytes of K/V copies in the prefix store")
        self.compiles = gauge("xla_compilations", "XLA compilations since the app was made (0 expected)")
        count_compilations()
        self._compiles_at_start = compilations()
        self.finished = pc.Counter(
            PREFIX + "request_finish", "Engine requests by finish reason", ["finish_reason"], registry=r
        )
        self.http = pc.Counter(
            PREFIX + "http_requests", "HTTP requests by path and status", ["path", "status"], registry=r
        )
        self.ttft = pc.Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from submit to the first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = pc.Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between a request's consecutive tokens (as the HTTP layer receives them)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.latency = pc.Histogram(
            PREFIX + "request_latency_seconds",
            "Seconds from submit to the end of a request",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )

    def finished_request(
        self,
        reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        seconds: float,
        cached_tokens: int = 0,
    ) -> None:
        self.finished.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.latency.observe(seconds)

    def render(self, stats: dict) -> bytes:
        """The text exposition, with the engine gauges set from ``stats`` first."""
        self.queue_depth.set(stats.get("queue_depth", 0))
        self.active_slots.set(stats.get("active_slots", 0))
        self.slots.set(stats.get("slots", 0))
        self.held_rows.set(stats.get("held_rows", 0))
        self.store_bytes.set(stats.get("prefix_store_bytes", 0))
        self.compiles.set(compilations() - self._compiles_at_start)
        admitted, prompt = stats.get("prefix_requests", 0), stats.get("prefix_prompt_tokens", 0)
        self.prefix_hit_rate.set(stats.get("prefix_hits", 0) / admitted if admitted else 0.0)
        self.prefix_reuse.set(stats.get("prefix_cached_tokens", 0) / prompt if prompt else 0.0)
        return self._latest(self.registry)


class StatusCounter:
    """ASGI middleware counting responses by path and status into ``Metrics.http``.

    Plain ASGI (no ``BaseHTTPMiddleware``), so streamed responses and client disconnects
    pass through untouched; paths outside ``known`` count as ``"other"`` (bounded labels).
    """

    def __init__(self, app, metrics: Metrics, known: Callable[[str], bool]):
        self.app, self.metrics, self.known = app, metrics, known

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        path = path if self.known(path) else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http.labels(path=path, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
