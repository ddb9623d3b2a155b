"""cucache's statistics for Prometheus (docs/python.md, "Metrics").

    import cucache.metrics
    print(cucache.metrics.text())                  # the exposition, as a /metrics body

    import prometheus_client
    cucache.metrics.register()                     # into prometheus_client's default registry
    prometheus_client.start_http_server(8000)      # every scrape reads cucache afresh

Every statistics field of every device used so far, per device, pool kind and tag, in
Prometheus' text format (version 0.0.4); the library writes it from its field tables
(cucacheWriteMetrics). prometheus_client is imported only by Collector and register().
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from ._lib import metrics_text

__all__ = ["Collector", "register", "text"]


def text() -> str:
    """The metrics now, in Prometheus' text exposition format."""
    return metrics_text()


class Collector:
    """A prometheus_client collector: each collect() reads cucache's statistics once and yields
    one metric family per exported field (gauges and counters as the library types them)."""

    def collect(self) -> Iterator[Any]:
        try:
            from prometheus_client.parser import text_string_to_metric_families
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "cucache.metrics.Collector needs prometheus_client (pip install prometheus-client); "
                "cucache.metrics.text() needs nothing"
            ) from e
        yield from text_string_to_metric_families(text())

    def describe(self) -> list[Any]:
        # No description ahead of a scrape: the families depend on the tags and devices in use,
        # and registering must not read (or create) the allocator.
        return []


def register(registry: Optional[Any] = None) -> Collector:
    """Registers a Collector with `registry` (prometheus_client's default REGISTRY when None) and
    returns it."""
    try:
        import prometheus_client
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("cucache.metrics.register needs prometheus_client (pip install prometheus-client)") from e
    collector = Collector()
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector
