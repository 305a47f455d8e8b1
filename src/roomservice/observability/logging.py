"""structlog configuration: one JSON object per line, context bound through contextvars.

JSON lines are encoded by orjson and written as bytes (every command logs one
``room_command_timing`` line; the stdlib encoder was the larger part of its
cost, docs/benchmarks.md). Values orjson cannot encode are written as their
``repr``, as structlog's own renderer does.

:func:`write_info_line` writes one such line without structlog's call chain
(the command path's timing line, issue 12): the same keys in the same order,
the same bytes but the timestamp, written and flushed under the same lock.
It writes only while structlog is still configured as :func:`configure_logging`
left it; otherwise (console output, ``capture_logs()`` in a test, another
configuration) it writes nothing and the caller logs through structlog.

:class:`log_context` names what every line logged inside it is about (a command, a
row, a delivery), as structlog's ``bound_contextvars`` does, for less per use.
"""

from __future__ import annotations

import contextvars
import datetime
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, TextIO

import orjson
import structlog
from structlog.contextvars import bind_contextvars


def _repr(value: Any) -> str:
    return repr(value)


def _orjson_dumps(event: Any, **_: Any) -> bytes:
    # OPT_NON_STR_KEYS: a dict with int keys in a log field must not fail the line
    return orjson.dumps(event, default=_repr, option=orjson.OPT_NON_STR_KEYS)


_streams: list[Any] = []  # the text streams whose byte buffers are logged to: closed if collected


@dataclass(frozen=True, slots=True)
class _JsonLines:
    """What :func:`configure_logging` installed for JSON lines on a byte stream, to tell it is still in place."""

    processors: list[Any]  # structlog keeps this list (capture_logs() edits it in place)
    renderer: Any
    factory: Any
    wrapper: Any
    logger: structlog.BytesLogger  # shares the stream's lock with every structlog logger on it
    info: bool  # the configured level lets info lines through

    def in_place(self) -> bool:
        config = structlog.get_config()
        processors = config["processors"]
        return (
            processors is self.processors
            and len(processors) == _CHAIN_LENGTH
            and processors[-1] is self.renderer
            and config["logger_factory"] is self.factory
            and config["wrapper_class"] is self.wrapper
        )


_CHAIN_LENGTH = 5  # merge_contextvars, add_log_level, TimeStamper, format_exc_info, the renderer
_json_lines: _JsonLines | None = None
_CONTEXT_PREFIX = "structlog_"  # structlog.contextvars' prefix of the context variables it binds
_UTC = datetime.UTC


def write_info_line(event: str, fields: dict[str, Any]) -> bool:
    """Write ``fields`` as the info line ``event``, exactly as ``logger.info(event, **fields)`` would;
    False (nothing written) when logging is not the JSON byte stream :func:`configure_logging` set up.

    ``fields`` is taken over (the line's keys are added to it). The steps are structlog's, in order:
    the event after the fields, bound context variables not already among them, the level, the
    ISO UTC timestamp; encoded by the renderer's serializer; one write and a flush under the lock.
    """
    lines = _json_lines
    if lines is None or not lines.in_place():
        return False
    if not lines.info:
        return True  # filtered out, as the bound logger's info() would
    fields["event"] = event
    context = contextvars.copy_context()
    for var in context:
        if var.name.startswith(_CONTEXT_PREFIX) and context[var] is not Ellipsis:
            fields.setdefault(var.name[len(_CONTEXT_PREFIX) :], context[var])
    fields["level"] = "info"
    fields["timestamp"] = iso_utc(time.time_ns())
    lines.logger.msg(_orjson_dumps(fields))
    return True


_second: tuple[int, str] = (-1, "")  # the last second formatted: its number, its text


def iso_utc(ns: int) -> str:
    """The time ``ns`` (nanoseconds since the epoch) as structlog's ``TimeStamper(fmt="iso", utc=True)``
    writes the present: ``datetime.now(UTC).isoformat()`` (microseconds floored, left out when 0) with
    ``Z`` for ``+00:00``. The date and time of day are formatted once a second (~2.4 -> 0.4 us a line)."""
    global _second
    second, rest = divmod(ns, 1_000_000_000)
    formatted, prefix = _second
    if formatted != second:
        prefix = datetime.datetime.fromtimestamp(second, tz=_UTC).isoformat()[:-6]  # without "+00:00"
        _second = (second, prefix)
    micro = rest // 1000
    return f"{prefix}.{micro:06d}Z" if micro else prefix + "Z"


def configure_logging(*, level: str = "info", json: bool = True, file: TextIO | None = None) -> None:
    global _json_lines
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    stream = file or sys.stdout
    binary: BinaryIO | None = getattr(stream, "buffer", None) if json else None
    factory: Any
    if binary is not None:
        renderer: structlog.typing.Processor = structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        factory = structlog.BytesLoggerFactory(file=binary)
        _streams[:] = [stream]
    else:  # console output, or a text stream without a byte buffer under it
        renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory(file=stream)
    chain = [*processors, renderer]
    number = logging.getLevelNamesMapping()[level.upper()]
    wrapper = structlog.make_filtering_bound_logger(number)
    structlog.configure(processors=chain, wrapper_class=wrapper, logger_factory=factory, cache_logger_on_first_use=True)
    _json_lines = None
    if binary is not None:
        assert len(chain) == _CHAIN_LENGTH
        _json_lines = _JsonLines(chain, renderer, factory, wrapper, factory(), number <= logging.INFO)


class log_context:  # lower case: used like the context manager function it replaces
    """``with log_context(event_id=...)``: every line logged inside carries these values.

    ``structlog.contextvars.bound_contextvars`` at a fraction of its cost, for the hot paths
    (a command, an outbox row, a consumer delivery): that one reads the whole context first to
    save what it overrides and is a generator context manager; the contextvars' own tokens put
    back exactly the values before (or their absence). The variables are structlog's own (so
    ``merge_contextvars``, ``get_contextvars`` and ``clear_contextvars`` see them), looked up once
    per name instead of a prefixed name built and looked up per value and per reset."""

    __slots__ = ("_tokens", "_values")

    def __init__(self, **values: Any) -> None:
        self._values = values

    def __enter__(self) -> None:
        variables = _variables
        tokens = []
        for name, value in self._values.items():
            var = variables.get(name)
            if var is None:
                var = _variable(name)
            tokens.append(var.set(value))
        self._tokens = tokens

    def __exit__(self, *exc: object) -> None:
        for token in reversed(self._tokens):
            token.var.reset(token)


_variables: dict[str, contextvars.ContextVar[Any]] = {}


def context_variable(name: str) -> contextvars.ContextVar[Any]:
    """structlog's context variable of ``name``: ``token = var.set(value)``, then ``var.reset(token)``,
    binds ``name`` for every line logged in between as ``with log_context(name=value)`` does, at a
    sixth of its cost (~0.1 against ~0.7 µs): for a hot path's own values, looked up once."""
    var = _variables.get(name)
    return var if var is not None else _variable(name)


def _variable(name: str) -> contextvars.ContextVar[Any]:
    """structlog's context variable of ``name`` (created by structlog when it has none yet)."""
    token = bind_contextvars(**{name: Ellipsis})[name]
    token.var.reset(token)
    _variables[name] = token.var
    return token.var


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
