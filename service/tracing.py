"""Distributed tracing with OpenTelemetry: a span per Retrieve RPC, one per batch and one
per pipeline stage of each batch (docs/ops/tracing.md).

    caller's traceparent ─► [Retrieve RPC span]  (service/server.py; SERVER kind)
                                   ▲ link, one per request of the batch (child of the first)
                            [batch span]  (service/pipeline/runner.py: from dispatch to
                              ├─ input     the end of stage 4)
                              ├─ features
                              ├─ compute
                              └─ post

The batcher carries each request's span context to its batch (`Pending.trace`). Off by
default (every hook then returns at once); a setting that cannot work is a one-line
`TracingError` at the very start, before the model and index load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.errors import StartupError

EXPORTERS = ("off", "console", "otlp")
EXPORT_TIMEOUT_SECONDS = 5.0  # one export to an unreachable collector gives up after this
_PROPAGATOR = TraceContextTextMapPropagator()
log = logging.getLogger("grace.tracing")


class TracingError(StartupError):
    """Tracing cannot start as configured (one line: the setting and what to do)."""


def otlp_endpoint() -> str:
    """Where `otlp` exports: the standard variables, in the OTLP exporter's own order."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317"
    )


def exporter_for(kind: str) -> SpanExporter:
    """The span exporter of the `tracing` setting (tests put an in-memory one here)."""
    if kind == "console":  # one JSON object per line, on stderr beside the logs
        return ConsoleSpanExporter(
            out=sys.stderr, formatter=lambda s: s.to_json(indent=None) + "\n"
        )
    if kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingError(
                "tracing = 'otlp' needs the OTLP exporter: pip install 'grace-serving[otlp]'"
            ) from exc
        return OTLPSpanExporter(endpoint=otlp_endpoint(), timeout=EXPORT_TIMEOUT_SECONDS)
    raise TracingError(f"tracing must be one of {', '.join(EXPORTERS)}, got {kind!r}")


class Tracing:
    """The tracer of one serving process (or none: every hook then does nothing)."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self._tracer = provider.get_tracer("grace.serving") if provider is not None else None

    @classmethod
    def from_settings(cls, kind: str, sample_ratio: float = 1.0, **resource: Any) -> Tracing:
        """`kind` is the `tracing` setting; `resource`: attributes naming this process."""
        if kind == "off":
            log.debug("tracing off")
            return cls()
        provider = TracerProvider(
            resource=Resource.create({"service.name": "grace-serving", **resource}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        timeout_ms = int(EXPORT_TIMEOUT_SECONDS * 1e3)
        provider.add_span_processor(
            BatchSpanProcessor(exporter_for(kind), export_timeout_millis=timeout_ms)
        )
        where = otlp_endpoint() if kind == "otlp" else "stderr"
        log.info("tracing on: %s exporter to %s, sample ratio %g", kind, where, sample_ratio)
        return cls(provider)

    @contextlib.contextmanager
    def rpc(self, method: str, metadata: Sequence[tuple[str, Any]] | None) -> Iterator[Span | None]:
        """The span of one RPC, current while the handler runs (so the batcher sees it),
        its parent the caller's `traceparent`; None when tracing is off."""
        if self._tracer is None:
            yield None
            return
        carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
        parent = _PROPAGATOR.extract(carrier)
        service, _, name = method.strip("/").rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        with self._tracer.start_as_current_span(
            method.strip("/"), context=parent, kind=SpanKind.SERVER, attributes=attributes,
            record_exception=False, set_status_on_exception=False,
        ) as span:  # fmt: skip
            yield span

    def current(self) -> SpanContext | None:
        """The current span's context (the RPC's, in its handler) if it is sampled: what
        the batch links to; None when tracing is off or the call is not traced."""
        if self._tracer is None:
            return None
        ctx = trace.get_current_span().get_span_context()
        return ctx if ctx.is_valid and ctx.trace_flags.sampled else None

    def batch(
        self, calls: Sequence[SpanContext | None], attributes: Mapping[str, Any]
    ) -> Span | None:
        """A batch's span (ended by `end`): a child of its first traced call's span, linked
        to every traced call's; None when none of its calls is traced (sampled out, or
        the start-up warm-up), so sampling calls samples their batches."""
        traced = [c for c in calls if c is not None]
        if self._tracer is None or not traced:
            return None
        parent = trace.set_span_in_context(
            trace.NonRecordingSpan(traced[0]), otel_context.Context()
        )
        return self._tracer.start_span(
            "batch", context=parent, kind=SpanKind.INTERNAL,
            links=[Link(c) for c in traced], attributes=dict(attributes),
        )  # fmt: skip

    @contextlib.contextmanager
    def stage(self, batch: Span | None, name: str) -> Iterator[Span | None]:
        """A stage's span, a child of its batch's (on the stage's thread); an exception
        marks it failed."""
        if self._tracer is None or batch is None:
            yield None
            return
        parent = trace.set_span_in_context(batch, otel_context.Context())
        with self._tracer.start_as_current_span(name, context=parent) as span:
            yield span

    @staticmethod
    def end(span: Span | None, error: str | None = None, **attributes: Any) -> None:
        """End a span (an RPC's or a batch's), with its outcome."""
        if span is None:
            return
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, value)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is finished (tests; a drain calls `shutdown`)."""
        return self.provider is None or self.provider.force_flush(int(timeout_s * 1e3))

    def shutdown(self, timeout_s: float = 2.0) -> bool:
        """Export what is left and stop the exporter, at the end of a drain, within
        `timeout_s` (a collector that does not answer must not hold the exit); False
        when the time ran out and spans may be lost."""
        if self.provider is None:
            return True
        provider = self.provider
        done = threading.Event()

        def stop() -> None:
            provider.shutdown()
            done.set()

        threading.Thread(target=stop, name="grace-tracing-shutdown", daemon=True).start()
        return done.wait(timeout_s)
