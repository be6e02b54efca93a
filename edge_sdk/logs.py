"""Logging set-up shared by the `edgefl` commands and any app that embeds the SDK.

* `RateLimit`: a `logging.Filter` that lets a burst of records with the same key through, then
  at most one per interval, and tells how many it held back when the next one passes. The key
  is the logger, level and message template by default; pass `key` to rate-limit per sender,
  per topic, or anything a record carries (`record.args`, attributes set with `extra=`).
* `JsonFormatter`: one JSON object per line (time, level, logger, message, process, thread,
  exception, and every `extra=` attribute), for log shippers.
* `configure_logging`: the root handler the CLI installs: a level, `text` or `json`, stderr or
  a file, with a `RateLimit` on warnings and above.

Filters attached to a handler see every record that reaches it, whichever logger emitted it;
filters attached to a logger see only that logger's own records. `configure_logging` therefore
puts its rate limit on the handler.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "OWN_PACKAGES",
    "JsonFormatter",
    "LogFormat",
    "RateLimit",
    "configure_logging",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[str, ...]] = ("text", "json")
LOG_LEVELS: Final[tuple[str, ...]] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT: Final[str] = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# edgefl's own packages: `configure_logging(libraries=...)` logs the others' at another level.
OWN_PACKAGES: Final[tuple[str, ...]] = ("coordinator", "edge_sdk", "model_zoo")
_OURS: Final[str] = "_edgefl_handler"

# The attributes every LogRecord has; whatever else a record carries came from `extra=`.
_STANDARD_ATTRS: Final[frozenset[str]] = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__
) | {"message", "asctime", "taskName"}


def _default_key(record: logging.LogRecord) -> Hashable:
    return (record.name, record.levelno, str(record.msg))


class RateLimit(logging.Filter):
    """Let `burst` records of one key through per `interval_s` seconds; hold back the rest.

    The first record let through after some were held back says how many (appended to its
    message, and as `record.suppressed`). Records below `min_level` always pass. Keys not seen
    for a while are forgotten, so memory stays bounded by the number of active keys
    (at most `max_keys`; the oldest are dropped beyond that). A record `key` cannot handle
    (it raises) is keyed by logger, level and template instead.

        handler.addFilter(RateLimit(interval_s=60, key=lambda r: (r.msg, r.args[0])))
    """

    def __init__(
        self,
        interval_s: float = 60.0,
        burst: int = 3,
        *,
        key: Callable[[logging.LogRecord], Hashable] = _default_key,
        min_level: int = logging.WARNING,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if interval_s <= 0 or burst < 1:
            raise ValueError(f"interval_s must be > 0 and burst >= 1, got {interval_s}, {burst}")
        self.interval_s = interval_s
        self.burst = burst
        self.key = key
        self.min_level = min_level
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        # key -> [window start, records let through in it, records held back since the last]
        self._state: dict[Hashable, list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level:
            return True
        try:
            key = self.key(record)
        except Exception:  # a key that does not fit this record must never break logging
            key = _default_key(record)
        now = self._clock()
        with self._lock:
            state = self._state.get(key)
            if state is None or now - state[0] >= self.interval_s:
                held = int(state[2]) if state is not None else 0
                self._state.pop(key, None)
                self._state[key] = [now, 1, 0]
                self._forget_old(now)
            elif state[1] < self.burst:
                held = int(state[2])
                state[1] += 1
                state[2] = 0
            else:
                state[2] += 1
                return False
        if held:
            record.suppressed = held
            record.msg = f"{record.msg} [{held} similar message(s) suppressed]"
        return True

    def _forget_old(self, now: float) -> None:
        if len(self._state) <= self.max_keys:
            return
        for k in [k for k, s in self._state.items() if now - s[0] >= self.interval_s]:
            del self._state[k]
        while len(self._state) > self.max_keys:  # dicts keep insertion order: oldest first
            del self._state[next(iter(self._state))]


class JsonFormatter(logging.Formatter):
    """One JSON object per record: `time` (ISO 8601, UTC), `level`, `logger`, `message`,
    `process`, `thread`, `exception` when there is one, and the record's `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        for k, v in record.__dict__.items():
            if k not in _STANDARD_ATTRS and k not in out:
                out[k] = v if isinstance(v, str | int | float | bool | None) else repr(v)
        return json.dumps(out, ensure_ascii=False)


class _Stderr(logging.StreamHandler):
    """A handler to whatever `sys.stderr` is when a record is written: an app (or a test
    harness) that swaps it after configuring gets the records, and none go to a closed one."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler's constructor sets it: ignored
        pass


def configure_logging(
    level: int | str = logging.WARNING,
    *,
    fmt: LogFormat = "text",
    file: str | Path | None = None,
    rate_limit: RateLimit | None = None,
    libraries: int | None = None,
) -> logging.Handler:
    """Give the root logger one handler (replacing the one an earlier call installed; handlers
    installed by others stay): stderr, or `file` (appended to, its folder created). `fmt` is `text`
    or `json` (one object per line). Warnings and above pass through `rate_limit` (default: 3 per
    message template per minute). `libraries`: a higher level for every logger outside edgefl's
    packages (`OWN_PACKAGES`), whose DEBUG can be hundreds of lines (matplotlib's font manager),
    these packages' loggers set at `level`; None: `level` for all, and the packages' loggers as
    they are. Returns the handler.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    if isinstance(level, str):
        name = level.upper()
        if name not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
        level = getattr(logging, name)
    handler: logging.Handler
    if file is None:
        handler = _Stderr()
    else:
        path = Path(file).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(rate_limit if rate_limit is not None else RateLimit())
    handler.setLevel(level)  # loggers with a level of their own (torch's) stay below it too
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    for old in root.handlers[:]:
        if getattr(old, _OURS, False):  # handlers someone else installed stay
            root.removeHandler(old)
            old.close()
    root.addHandler(handler)
    ours = int(level)
    others = ours if libraries is None else max(ours, libraries)
    root.setLevel(others)
    if libraries is not None:  # (an app's own levels for edgefl's packages stay without it)
        for name in OWN_PACKAGES:  # NOTSET: the root's level, as before any call
            logging.getLogger(name).setLevel(ours if others > ours else logging.NOTSET)
    return handler
