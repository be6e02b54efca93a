"""Log lines about bad input at most once per sender and reason per interval.

A flood of 10,000 malformed messages must not become 10,000 log lines: `RateLimitedLog` logs
the first of each (sender, reason) key, counts the others in silence, and says how many it held
back when the key logs again after `interval_s`. The keys kept are bounded (the oldest are
forgotten first), since a flood may name arbitrary topics. Counting for the metrics stays with
the caller: every rejection is counted, only the log lines are limited.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    def __init__(
        self, logger: logging.Logger, interval_s: float = 60.0, max_keys: int = 1024
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._keys: OrderedDict[Hashable, list[float]] = OrderedDict()  # key: [logged at, held]

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log `msg % args` unless `key` logged within the interval; True when it was logged."""
        now = time.monotonic()
        with self._lock:
            entry = self._keys.get(key)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                self._keys.move_to_end(key)
                return False
            held = int(entry[1]) if entry is not None else 0
            self._keys[key] = [now, 0]
            self._keys.move_to_end(key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        if held:
            msg += f" (and {held} more like it in the last {self.interval_s:.0f} s)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)
