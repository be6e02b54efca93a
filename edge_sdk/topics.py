"""Topic names: the one place they are spelled, so no module concatenates them ad hoc.

Topics carry identity: every sender publishes only on topics that name it, so a broker ACL that
binds a username to topics also binds it to what it may say, and receivers trust the topic, not
a message's `sender` field. The layout of run `R`:

    edgefl/R/status                    retained, coordinator only: incarnation, round, phase
    edgefl/R/down/C                    coordinator -> client C: registered, tasks, shutdown
    edgefl/R/up/C                      client C -> coordinator: register, replies, blob chunks
    edgefl/R/bcast                     coordinator -> all: chunks of models many tasks share
    edgefl/R/peer/O/pub/...            retained: client O's published model (manifest + chunks)
    edgefl/R/peer/T/from/S             client S -> client T: peer messages (FedeRiCo)

A mosquitto ACL then says it all for client usernames (`%u`): write `up/%u`, `peer/%u/pub/#`
and `peer/+/from/%u`; read `status`, `bcast`, `down/%u`, `peer/+/pub/#` and `peer/%u/from/+`
(see `acl_patterns`).
"""

from __future__ import annotations

import re

__all__ = [
    "COORDINATOR",
    "ID_PATTERN",
    "ROOT",
    "acl_patterns",
    "bcast",
    "check_id",
    "down",
    "filters_overlap",
    "origin_of",
    "peer_inbox",
    "peer_message",
    "peer_publication",
    "peer_publications",
    "status",
    "topic_matches",
    "up",
    "up_all",
    "writer_of",
]

ID_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
_ID = re.compile(ID_PATTERN)
ROOT = "edgefl"
COORDINATOR = "coordinator"  # the sender name of every coordinator message


def check_id(value: str, what: str = "id") -> str:
    """Ids become topic levels and file names (keys, credentials, state): letters, digits, '_',
    '.', '-' only (no '/', '+', '#'), and not '.' or '..'."""
    if not isinstance(value, str) or not _ID.match(value) or value in (".", ".."):
        raise ValueError(
            f"{what} {value!r} must be 1-128 of letters, digits, '_', '.', '-' (not '.' or '..')"
        )
    return value


def _run(run: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}"


def status(run: str) -> str:
    """Retained: where the run is (written by the coordinator only)."""
    return f"{_run(run)}/status"


def archive(run: str) -> str:
    """Retained after the run: models for clients that join later (PersFL's archive of global
    models), chunks on its sub-topics; written by the coordinator, read by anyone."""
    return f"{_run(run)}/archive"


def down(run: str, client_id: str) -> str:
    """Coordinator -> one client."""
    return f"{_run(run)}/down/{check_id(client_id, 'client id')}"


def up(run: str, client_id: str) -> str:
    """One client -> coordinator."""
    return f"{_run(run)}/up/{check_id(client_id, 'client id')}"


def up_all(run: str) -> str:
    """The filter the coordinator subscribes to: every client's up topic."""
    return f"{_run(run)}/up/+"


def bcast(run: str) -> str:
    """Coordinator -> every client: chunks of models that many tasks share."""
    return f"{_run(run)}/bcast"


def peer_publication(run: str, owner: str, name: str = "model") -> str:
    """Retained publications of one client (a decentralized algorithm's current model)."""
    return f"{_run(run)}/peer/{check_id(owner, 'client id')}/pub/{check_id(name, 'name')}"


def peer_publications(run: str) -> str:
    """The filter matching every client's publications."""
    return f"{_run(run)}/peer/+/pub/#"


def peer_message(run: str, to: str, sender: str) -> str:
    """Client `sender` -> client `to` (FedeRiCo gradients)."""
    return f"{_run(run)}/peer/{check_id(to, 'client id')}/from/{check_id(sender, 'client id')}"


def peer_inbox(run: str, to: str) -> str:
    """The filter a client subscribes to for peer messages meant for it."""
    return f"{_run(run)}/peer/{check_id(to, 'client id')}/from/+"


def origin_of(topic: str, run: str) -> str | None:
    """The client a topic names as its writer: `up/C`, `peer/C/pub/...`, `peer/T/from/C`.

    None for topics no client writes (status, down, bcast) or that do not belong to `run`.
    """
    prefix = _run(run) + "/"
    if not topic.startswith(prefix):
        return None
    parts = topic[len(prefix) :].split("/")
    cid = None
    if (len(parts) == 2 and parts[0] == "up") or (
        len(parts) >= 4 and parts[0] == "peer" and parts[2] == "pub"
    ):
        cid = parts[1]
    elif len(parts) == 4 and parts[0] == "peer" and parts[2] == "from":
        cid = parts[3]
    return cid if cid is not None and _ID.match(cid) else None


def writer_of(topic: str) -> tuple[str, str] | None:
    """(run, the one participant who may write `topic`): the client an `up`, `peer` or
    `pub` topic names, the coordinator for `status`, `down`, `bcast` and `archive` (and their
    sub-topics). None for a topic outside the layout. Receivers check a message's signature
    against this writer's key."""
    parts = topic.split("/")
    if len(parts) < 3 or parts[0] != ROOT or not _ID.match(parts[1]):
        return None
    run, rest = parts[1], parts[2:]
    if rest[0] in ("status", "bcast", "archive") and (len(rest) == 1 or rest[0] == "archive"):
        return run, COORDINATOR
    if len(rest) == 2 and rest[0] == "down" and _ID.match(rest[1]):
        return run, COORDINATOR
    client = origin_of(topic, run)
    return None if client is None else (run, client)


def acl_patterns(run: str = "+") -> dict[str, list[str]]:
    """mosquitto ACL `pattern` lines for client usernames (`%u`), by access."""
    base = f"{ROOT}/{run}"
    return {
        "write": [f"{base}/up/%u", f"{base}/peer/%u/pub/#", f"{base}/peer/+/from/%u"],
        "read": [
            f"{base}/status",
            f"{base}/bcast",
            f"{base}/down/%u",
            f"{base}/peer/+/pub/#",
            f"{base}/peer/%u/from/+",
            f"{base}/archive",
            f"{base}/archive/+",
        ],
    }


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT topic-filter matching with '+' (one level) and '#' (the rest)."""
    pat, top = pattern.split("/"), topic.split("/")
    for i, p in enumerate(pat):
        if p == "#":
            return True
        if i >= len(top) or (p != "+" and p != top[i]):
            return False
    return len(pat) == len(top)


def filters_overlap(a: str, b: str) -> bool:
    """Whether some topic matches both filters (brokers may deliver it once or twice)."""
    pa, pb = a.split("/"), b.split("/")
    for x, y in zip(pa, pb, strict=False):
        if x == "#" or y == "#":
            return True
        if x != y and "+" not in (x, y):
            return False
    return len(pa) == len(pb) or "#" in (pa[len(pb)] if len(pa) > len(pb) else pb[len(pa)])
