"""structlog configuration: one JSON object per line, context bound through contextvars.

JSON lines are encoded by orjson and written as bytes (every command logs one
``room_command_timing`` line; the stdlib encoder was the larger part of its
cost, docs/benchmarks.md). Values orjson cannot encode are written as their
``repr``, as structlog's own renderer does.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, BinaryIO, TextIO

import orjson
import structlog


def _repr(value: Any) -> str:
    return repr(value)


def _orjson_dumps(event: Any, **_: Any) -> bytes:
    # OPT_NON_STR_KEYS: a dict with int keys in a log field must not fail the line
    return orjson.dumps(event, default=_repr, option=orjson.OPT_NON_STR_KEYS)


_streams: list[Any] = []  # the text streams whose byte buffers are logged to: closed if collected


def configure_logging(*, level: str = "info", json: bool = True, file: TextIO | None = None) -> None:
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
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
