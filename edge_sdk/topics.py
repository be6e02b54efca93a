"""Topic names: the one place they are spelled, so no module concatenates them ad hoc."""

from __future__ import annotations

import re

__all__ = ["check_id", "client_inbox", "coordinator_inbox", "topic_matches"]

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
ROOT = "edgefl"


def check_id(value: str, what: str = "id") -> str:
    """Ids become topic levels: letters, digits, '_', '.', '-' only (no '/', '+', '#')."""
    if not _ID.match(value):
        raise ValueError(f"{what} {value!r} must be 1-128 of letters, digits, '_', '.', '-'")
    return value


def coordinator_inbox(run: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}/coordinator"


def client_inbox(run: str, client_id: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}/client/{check_id(client_id, 'client id')}"


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT topic-filter matching with '+' (one level) and '#' (the rest)."""
    pat, top = pattern.split("/"), topic.split("/")
    for i, p in enumerate(pat):
        if p == "#":
            return True
        if i >= len(top) or (p != "+" and p != top[i]):
            return False
    return len(pat) == len(top)
