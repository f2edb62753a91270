"""holdfast_contract.logs: the one set-up every command line uses."""

from __future__ import annotations

import ast
import io
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from holdfast_contract import logs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    yield stream
    logs.setup("console", "warning")  # later tests in this process log to stderr again


def test_json_lines_carry_level_time_and_stdlib_records(out: io.StringIO) -> None:
    logs.setup("json", "info", stream=out)
    structlog.get_logger("t").info("promoted", engine="e2", epoch=3)
    structlog.get_logger("t").debug("below the level")
    logging.getLogger("aiohttp.server").warning("slow %s", "client")
    logging.getLogger("aiohttp.access").info("stdlib info stays quiet")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["promoted", "slow client"]
    assert lines[0]["engine"] == "e2" and lines[0]["level"] == "info"
    assert lines[0]["timestamp"].endswith("Z")
    assert lines[1]["logger"] == "aiohttp.server" and lines[1]["level"] == "warning"


def test_debug_level_and_console_format(out: io.StringIO) -> None:
    logs.setup("console", "debug", stream=out)
    structlog.get_logger("t").debug("tick", due=1.5)
    assert "[debug" in out.getvalue() and "due=1.5" in out.getvalue()


def test_console_tracebacks_are_plain_lines_without_the_frames_locals(out: io.StringIO) -> None:
    """An error logged with its traceback (an asyncio callback's, from the event loop
    itself) costs the loop a plain traceback's formatting, not a rich one that renders
    every frame's locals in boxes."""
    logs.setup("console", "info", stream=out)
    secret_local = "a local of the failing frame"  # noqa: F841  # what a rich one would show
    try:
        raise OSError(9, "Bad file descriptor")
    except OSError:
        logging.getLogger("asyncio").error("Exception in callback", exc_info=True)
    text = out.getvalue()
    assert "Traceback (most recent call last):" in text
    assert "OSError: [Errno 9] Bad file descriptor" in text
    assert "secret_local" not in text and "a local of the failing frame" not in text
    assert "\u256d" not in text and "\u2502" not in text  # no box drawing


def test_a_second_setup_replaces_the_first(out: io.StringIO) -> None:
    logs.setup("json", "info", stream=io.StringIO())
    logs.setup("json", "info", stream=out)
    logging.getLogger("x").error("once")
    assert out.getvalue().count("once") == 1


def test_unknown_format_or_level_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="console, json, auto"):
        logs.setup("xml")
    with pytest.raises(ValueError, match="debug, info, warning, error"):
        logs.setup("json", "loud")


def test_the_module_imports_only_stdlib_and_structlog() -> None:
    tree = ast.parse((ROOT / "holdfast_contract" / "logs.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    tops = {n.split(".")[0] for n in names}
    assert tops - set(sys.stdlib_module_names) - {"__future__"} == {"structlog"}
