"""The one logging set-up every holdfast process uses: structlog key-value lines or JSON.

`setup(fmt, level)` is called once, first thing, by each command line (`supervisor`,
`cachedaemon`, `python -m engine`, `python -m engine.forkserver`, `chaos`). `fmt` and
`level` are the policy's `log.format` and `log.level` (or the `--log-format` flag):

- `console`: `2026-12-01T04:00:00.123456Z [info     ] promoted  engine=e2 epoch=3`
- `json`: one object a line, `{"engine": "e2", "epoch": 3, "event": "promoted",
  "level": "info", "timestamp": "2026-12-01T04:00:00.123456Z"}`
- `auto`: console when the stream is a terminal, JSON otherwise.

Records from the standard library's `logging` (aiohttp, asyncio, aiomqtt) go through the
same renderer to the same stream, at WARNING and above (or `level`, when higher), so a
process writes one format only. Imports only the standard library and structlog.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

FORMATS = ("console", "json", "auto")
LEVELS = ("debug", "info", "warning", "error")


class _Handler(logging.StreamHandler[TextIO]):
    """The stdlib handler `setup` installs (a second `setup` replaces it). Without a stream
    of its own it writes to whatever `sys.stderr` is when a record comes."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(sys.stderr if stream is None else stream)
        self._follow = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow:
            self.stream = sys.stderr
        super().emit(record)


def _level(level: str) -> int:
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    return logging.getLevelNamesMapping()[level.upper()]


def _renderer(fmt: str, stream: TextIO) -> structlog.types.Processor:
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    # plain tracebacks: a rich one (structlog's default where rich is installed) renders
    # every frame's locals, and its first one imports rich's syntax highlighting: about
    # 0.3 s of the supervisor's event loop for one asyncio callback error (seen as a
    # failover 330 ms late on a 2-core machine, the broker's socket error logged just before)
    return structlog.dev.ConsoleRenderer(
        colors=stream.isatty(), exception_formatter=structlog.dev.plain_traceback
    )


def setup(fmt: str = "console", level: str = "info", *, stream: TextIO | None = None) -> None:
    """Send structlog (and stdlib logging) to `stream` (stderr) as `fmt`, from `level` up."""
    out = sys.stderr if stream is None else stream
    threshold = _level(level)
    renderer = _renderer(fmt, out)
    stamped: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if isinstance(renderer, structlog.processors.JSONRenderer):
        stamped.append(structlog.processors.format_exc_info)
    structlog.configure(
        processors=[*stamped, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    handler = _Handler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamped],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)  # set up again (tests run several commands in one process)
    root.addHandler(handler)
    root.setLevel(max(threshold, logging.WARNING))
