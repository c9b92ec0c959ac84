"""Trace-context propagation through the envelope (optional OpenTelemetry).

When ``opentelemetry-api`` is installed (``pip install sqla-outbox[otel]``), the
dispatching code's current trace context is injected into the envelope's ``trace``
carrier (W3C ``traceparent``/``tracestate``), and the worker starts the handler span as a
child of it, so one trace covers the request that dispatched and the run that executed.
Without OpenTelemetry both ends are no-ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

try:  # optional dependency
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - exercised when the extra is absent
    otel_context = None  # type: ignore[assignment]
    propagate = None  # type: ignore[assignment]
    trace = None  # type: ignore[assignment]

TRACER_NAME = "sqla_outbox"


MAX_VALUE_CHARS = 8192
"""Longest ``traceparent``/``tracestate`` value carried (characters). W3C Trace Context
allows 32 ``tracestate`` members of up to 256 characters each (about 8 KiB); a longer
value is dropped at dispatch (the W3C rules allow dropping ``tracestate``), and the worker
refuses envelopes that carry one."""


def current_carrier() -> dict[str, str]:
    """The current trace context as a W3C carrier dict; empty without OpenTelemetry.

    Empty at once when there is no valid current span context (no span started and no
    remote context attached): the W3C propagator injects nothing then, and the carrier
    keeps only its ``traceparent``/``tracestate``, so this skips the propagators' work for
    the common untraced dispatch without changing what is carried. The cheapest such
    case, an empty OpenTelemetry context (nothing attached at all), is checked first.
    """
    if propagate is None or trace is None or otel_context is None:
        return {}
    context = otel_context.get_current()
    if not context or not trace.get_current_span(context).get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {
        k: v
        for k, v in carrier.items()
        if k in ("traceparent", "tracestate") and isinstance(v, str) and len(v) <= MAX_VALUE_CHARS
    }


@contextlib.contextmanager
def handler_span(name: str, carrier: Mapping[str, str], attributes: Mapping[str, Any]) -> Iterator[Any]:
    """Run the body inside a CONSUMER span continuing the trace in ``carrier``.

    Yields the span (or None without OpenTelemetry). Exceptions are recorded on the span
    and re-raised.
    """
    if trace is None or propagate is None or otel_context is None:
        yield None
        return
    parent = propagate.extract(dict(carrier))
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        name,
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes={k: v for k, v in attributes.items() if v is not None},
    ) as span:
        yield span
