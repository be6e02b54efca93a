"""edge_sdk.logs: the rate limit on repeated warnings, JSON records, and the CLI's set-up."""

from __future__ import annotations

import io
import json
import logging

import pytest
from typer.testing import CliRunner

from edge_sdk.logs import JsonFormatter, RateLimit, configure_logging


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _logger(flt: logging.Filter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(flt)
    logger = logging.getLogger(f"test.ratelimit.{id(flt)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out


def test_a_burst_passes_then_one_per_interval_saying_how_many_were_held():
    clock = _Clock()
    log, out = _logger(RateLimit(interval_s=10, burst=3, clock=clock))
    for i in range(10):
        log.warning("peer %s sent garbage", f"p{i}")  # one template: one key
    clock.now += 10
    log.warning("peer %s sent garbage", "late")
    lines = out.getvalue().splitlines()
    assert lines == [
        "WARNING peer p0 sent garbage",
        "WARNING peer p1 sent garbage",
        "WARNING peer p2 sent garbage",
        "WARNING peer late sent garbage [7 similar message(s) suppressed]",
    ]


def test_keys_are_independent_and_can_be_per_sender():
    clock = _Clock()
    per_sender = RateLimit(interval_s=10, burst=1, key=lambda r: (r.msg, r.args[0]), clock=clock)
    log, out = _logger(per_sender)
    for _ in range(3):
        log.warning("rejected a message from %s", "c1")
        log.warning("rejected a message from %s", "c2")
        log.error("something else")  # no args: keyed by its template, its own budget
    assert out.getvalue().splitlines() == [
        "WARNING rejected a message from c1",
        "WARNING rejected a message from c2",
        "ERROR something else",
    ]


def test_records_below_the_minimum_level_always_pass():
    log, out = _logger(RateLimit(interval_s=10, burst=1, clock=_Clock()))
    for _ in range(5):
        log.info("progress")
    assert out.getvalue().count("progress") == 5


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="burst >= 1"):
        RateLimit(burst=0)


def test_json_records_carry_the_extra_fields():
    record = logging.LogRecord("edgefl.x", logging.WARNING, "f.py", 1, "bad %s", ("c3",), None)
    record.client = "c3"
    data = json.loads(JsonFormatter().format(record))
    assert data["message"] == "bad c3" and data["level"] == "WARNING"
    assert data["logger"] == "edgefl.x" and data["client"] == "c3"
    assert data["time"].endswith("Z")


def test_configure_logging_refuses_unknown_levels_and_formats():
    with pytest.raises(ValueError, match="log level must be one of"):
        configure_logging("LOUD")
    with pytest.raises(ValueError, match="log format must be one of"):
        configure_logging(fmt="xml")  # type: ignore[arg-type]


def test_records_go_to_the_stderr_of_the_moment_not_the_one_configured_with(monkeypatch):
    # An app (or pytest's capture) swaps sys.stderr after configuring; the one configured with
    # may be closed by then.
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    handler = configure_logging("WARNING")
    try:
        first.close()
        monkeypatch.setattr("sys.stderr", second)
        logging.getLogger("test.stderr").warning("after the swap")
    finally:
        logging.getLogger().removeHandler(handler)
    assert second.getvalue().endswith("WARNING test.stderr: after the swap\n"), second.getvalue()


def test_the_cli_rate_limits_a_repeated_warning(tmp_path):
    from coordinator.cli import app

    noisy = tmp_path / "noisy_plugin_rl.py"
    noisy.write_text(
        "import logging\n"
        "for i in range(50):\n"
        "    logging.getLogger('noisy').warning('the same warning, again (%d)', i)\n"
    )
    res = CliRunner().invoke(app, ["zoo", "--plugin", str(noisy)])
    assert res.exit_code == 0, res.output
    assert res.output.count("the same warning, again") == 3
