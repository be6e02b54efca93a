"""Broker access control for a federation: a mosquitto config, password file and ACL from the
topic layout, plus every participant's signing key.

`write_broker_files` gives every client a user named after its client id and the coordinator a
user of its own, each with a random password (hashed in the password file the way
`mosquitto_passwd` hashes it; in clear only in a 0600 file per user under `credentials/`). The ACL
lets client `X` write only its own up and peer topics and read only its own down topic, the
broadcast and status topics, published peer models and peer messages meant for it
(`edge_sdk.topics.acl_patterns`); the coordinator may read and write the run's whole tree. The
config ties every MQTT client id to its user name (`use_username_as_clientid`), so valid
credentials cannot take over another participant's session, and keeps large queues so that one
client's flood does not make the broker drop others' messages. `keys/` holds each participant's
Ed25519 signing key and the run's roster (`edge_sdk.auth.issue_keys`).

The files run as written under a stock mosquitto: `mosquitto -c OUT/mosquitto.conf`. Started as
root, mosquitto drops to user `mosquitto` before it reads the password and ACL files and writes
its persistence, so those belong to group `mosquitto` (mode 640; the persistence directory to
user `mosquitto`) when this runs as root; otherwise the note returned says what to run.
"""

from __future__ import annotations

import base64
import grp
import hashlib
import os
import pwd
import secrets
from collections.abc import Sequence
from pathlib import Path

from edge_sdk import topics
from edge_sdk.auth import issue_keys

__all__ = ["MAX_PACKET_BYTES", "mosquitto_hash", "write_broker_files"]

_ITERATIONS = 101  # what mosquitto_passwd 2.x uses with its "$7$" (PBKDF2-SHA512) scheme
# The broker drops a publisher's connection over this: the SDK's chunks (2 MiB by default) and
# their headers fit, a flood of huge payloads does not.
MAX_PACKET_BYTES = 2 * 1024 * 1024 + 128 * 1024
BROKER_USER = "mosquitto"  # whom mosquitto runs as after it drops root


def mosquitto_hash(password: str, salt: bytes | None = None) -> str:
    """A mosquitto 2.x password-file hash: `$7$101$<salt>$<PBKDF2-SHA512>`, base64."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _ITERATIONS)
    b64 = base64.b64encode
    return f"$7${_ITERATIONS}${b64(salt).decode()}${b64(digest).decode()}"


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _broker_ids() -> tuple[int, int] | None:
    """(uid, gid) of the `mosquitto` user when we may hand files to it (we are root)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(BROKER_USER).pw_uid, grp.getgrnam(BROKER_USER).gr_gid
    except KeyError:
        return None


def _unreachable(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory on the way to `path` (itself included) that the user `uid` of group
    `gid` may not enter, or None."""
    for d in [*reversed(path.parents), path]:
        st = d.stat()
        if st.st_uid == uid:
            bit = 0o100
        elif st.st_gid == gid:
            bit = 0o010
        else:
            bit = 0o001
        if not st.st_mode & bit:
            return d
    return None


def write_broker_files(
    out: str | Path,
    clients: Sequence[str],
    *,
    coordinator_user: str = "coordinator",
    run: str = "+",
    port: int = 8883,
    tls_dir: str | Path | None = None,
) -> dict[str, Path | str]:
    """Write `mosquitto.conf`, `passwd`, `acl`, `credentials/<user>` and `keys/` into `out`.

    `run` restricts the rules to one run id ("+": any run); `port` is the listener's; `tls_dir`
    holds `ca.pem`, `broker.pem` and `broker.key` for a TLS listener (None: plain MQTT). Returns
    the paths written and `owner_note`, what was done (or is left to do) about file owners.
    """
    users = [topics.check_id(c, "client id") for c in clients]
    topics.check_id(coordinator_user, "coordinator user")
    if run != "+":
        topics.check_id(run, "run id")
    if coordinator_user in users:
        raise ValueError(
            f"a client may not be named like the coordinator's user {coordinator_user!r}"
        )
    if len(set(users)) != len(users):
        raise ValueError("client ids must be distinct")
    out = Path(out).resolve()
    creds = out / "credentials"
    creds.mkdir(parents=True, exist_ok=True)
    os.chmod(creds, 0o700)
    passwords = {u: secrets.token_urlsafe(18) for u in [coordinator_user, *users]}
    for user, pw in passwords.items():
        _write(creds / user, pw + "\n", 0o600)
    _write(
        out / "passwd", "".join(f"{u}:{mosquitto_hash(p)}\n" for u, p in passwords.items()), 0o640
    )
    rules = topics.acl_patterns(run)
    acl = [
        "# edgefl: generated by `edgefl broker-acl`",
        f"user {coordinator_user}",
        f"topic readwrite {topics.ROOT}/{run}/#",
        "",
        "# every client X (its user name is its client id): what only X may touch",
        *(f"pattern write {t}" for t in rules["write"]),
        *(f"pattern read {t}" for t in rules["read"] if "%u" in t),
        "",
        "# what every client may read",
        *(
            line
            for user in users
            for line in (
                f"user {user}",
                *(f"topic read {t}" for t in rules["read"] if "%u" not in t),
            )
        ),
    ]
    _write(out / "acl", "\n".join(acl) + "\n", 0o640)
    data = out / "persistence"
    data.mkdir(exist_ok=True)
    conf = [
        f"# edgefl: written by `edgefl broker-acl`; run as is: mosquitto -c {out}/mosquitto.conf",
        f"listener {port}",
    ]
    if tls_dir is not None:
        tls = Path(tls_dir).resolve()
        conf += [
            f"cafile {tls / 'ca.pem'}",
            f"certfile {tls / 'broker.pem'}",
            f"# the key must be readable by user {BROKER_USER}",
            f"keyfile {tls / 'broker.key'}",
            "# require_certificate true   # to demand client certificates too",
        ]
    conf += [
        "allow_anonymous false",
        f"password_file {out / 'passwd'}",
        f"acl_file {out / 'acl'}",
        "# One session per identity: a client's MQTT id is its user name, whatever it asks for.",
        "use_username_as_clientid true",
        "persistence true",
        f"persistence_location {data}/",
        "max_inflight_messages 100",
        "# Deep queues: one client's flood must not make the broker drop the others' messages.",
        "max_queued_messages 100000",
        "max_queued_bytes 0",
        f"max_packet_size {MAX_PACKET_BYTES}",
    ]
    _write(out / "mosquitto.conf", "\n".join(conf) + "\n", 0o644)
    ids = _broker_ids()
    if ids is not None:
        uid, gid = ids
        for path in (out / "passwd", out / "acl"):
            os.chown(path, 0, gid)
        os.chown(data, uid, gid)
        note = f"group {BROKER_USER}, mode 640 (mosquitto reads them after dropping root)"
        blocked = _unreachable(out, uid, gid)
        if blocked is not None:
            mode = blocked.stat().st_mode & 0o777
            note += (
                f"; but user {BROKER_USER} cannot enter {blocked} (mode {mode:o}): "
                f"chmod o+x {blocked}, or write the files elsewhere"
            )
    else:
        note = (
            f"mode 640, owned by you: if mosquitto runs as root it drops to user {BROKER_USER} "
            f"before reading them; then run as root: chgrp {BROKER_USER} {out}/passwd {out}/acl "
            f"&& chown {BROKER_USER} {data}"
        )
    keys = issue_keys(out / "keys", users)  # the coordinator signs as itself, whatever its user
    return {
        "passwd": out / "passwd",
        "acl": out / "acl",
        "credentials": creds,
        "keys": keys["roster"].parent,
        "mosquitto.conf": out / "mosquitto.conf",
        "owner_note": note,
    }
