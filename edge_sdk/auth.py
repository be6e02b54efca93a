"""Authenticated messages: every participant signs what it sends with its own Ed25519 key.

A run's keys are a *roster* (every participant's public key, by id: the coordinator's and each
client's; public, one file for everyone) and one private key per participant (a file only its
owner can read). `edgefl keys` (or `edgefl broker-acl`) issues them; the simulator makes
throw-away ones in memory.

What is signed is a message frame and the topic it is published on, so a message cannot be
moved to another topic (a task for c0 replayed on c1's down topic fails). A receiver takes the
signer from the topic (`edge_sdk.topics.writer_of`: `up/C` is C's, `down/C` and `status` are the
coordinator's) and drops a frame that is unsigned, signed by anyone else, or signed over other
bytes. Model chunks are not signed one by one: the signed message names each blob's sha256, so a
forged chunk can only make its blob fail the checksum, never make a forged model count.

Replays: every signed message carries a sequence number, strictly increasing per sender (the wall
clock in nanoseconds at the first message, +1 after). Receivers keep the last one seen per topic
(`ReplayGuard`, which a client keeps in its state directory, so a new process of it remembers)
and drop older ones. A status is a replay when its coordinator incarnation is older; within one
incarnation an older one is dropped quietly (a will, signed when the connection opened, is older
than the statuses published since: it only said the coordinator was offline). Exempt are
`presence` (signed when a connection opens and published later as a will; its epoch decides)
and retained publications (`published`, `archive`: read by fresh readers, their versions
decide). Across runs, every message binds to the coordinator incarnation it belongs to (a fresh
nonce per coordinator start; see `edge_sdk.protocol`), and task ids and sessions are random.

Signatures use `cryptography`'s Ed25519 (OpenSSL): about 50 µs to sign and 150 µs to verify a
message on one core here, nothing per chunk.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field

from edge_sdk import topics

__all__ = [
    "SIGNATURE_BYTES",
    "AuthError",
    "AuthSettings",
    "Keyring",
    "ReplayGuard",
    "issue_keys",
    "read_roster",
]

log = logging.getLogger(__name__)

SIGNATURE_BYTES = 64
_DOMAIN = b"edgefl-frame/1\0"  # what is signed starts here: a signature means nothing elsewhere
ROSTER_FILE = "roster.json"
# Kinds whose freshness is not a sequence number (see the module docstring).
UNSEQUENCED = frozenset({"presence", "published", "archive"})


class AuthError(ValueError):
    """Keys that cannot be used: a missing or unreadable file, a key that is not the roster's."""


class AuthSettings(BaseModel):
    """How a participant signs and checks messages (`[auth]` in a run config).

    `key_file`: this participant's private key (issued by `edgefl keys`; keep it mode 600).
    `roster`: the run's public keys (`roster.json`, the same file for everyone).
    `open`: run without keys. Messages are then neither signed nor checked, and anyone who can
    publish on the broker can speak for any participant: only for a broker nobody else reaches.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_file: Path | None = Field(
        None, description="this participant's private key (edgefl keys; keep it mode 600)"
    )
    roster: Path | None = Field(
        None, description="the run's public keys, roster.json (the same file for everyone)"
    )
    open: bool = Field(
        False,
        description="run without keys: nothing is signed or checked, and anyone on the broker "
        "can speak for anyone (only for a broker nobody else reaches)",
    )


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _public_raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def read_roster(path: str | Path) -> dict[str, Ed25519PublicKey]:
    """The public keys of `roster.json`, by participant id."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        keys = doc["keys"]
        return {
            topics.check_id(pid, "participant id"): Ed25519PublicKey.from_public_bytes(
                base64.b64decode(b64, validate=True)
            )
            for pid, b64 in keys.items()
        }
    except OSError as exc:
        raise AuthError(f"cannot read the roster {path}: {exc}") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AuthError(f"{path} is not an edgefl roster (edgefl keys writes one): {exc}") from exc


def _read_private(path: Path) -> Ed25519PrivateKey:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AuthError(f"cannot read the key file {path}: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise AuthError(f"{path} is not a private key written by edgefl keys: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise AuthError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s can be read by others (mode %o): chmod 600 it", path, mode & 0o777)
    return key


class Keyring:
    """One participant's identity (`me`, its private key) and whom it believes (the roster).

    Thread-safe: a client's serve loop, its peer channel and its will share one keyring.
    """

    def __init__(
        self, me: str, private: Ed25519PrivateKey, roster: Mapping[str, Ed25519PublicKey]
    ) -> None:
        self.me = topics.check_id(me, "participant id")
        ours = roster.get(me)
        if ours is None:
            raise AuthError(f"the roster has no key for {me!r}; issue one with edgefl keys")
        if _public_raw(ours) != _public_raw(private.public_key()):
            raise AuthError(f"this private key is not {me!r}'s in the roster (wrong key file?)")
        self._private = private
        self.roster = dict(roster)
        self._lock = threading.Lock()
        self._seq = 0

    @classmethod
    def load(cls, settings: AuthSettings, me: str) -> Keyring | None:
        """`me`'s keyring from its settings; None in open mode. Raises AuthError with what to
        do when the files are missing or do not fit together."""
        if settings.open:
            if settings.key_file or settings.roster:
                raise AuthError("auth.open is set together with keys: choose one")
            return None
        if settings.key_file is None or settings.roster is None:
            raise AuthError(
                "no keys: issue them with `edgefl keys --clients c0,c1,... --out DIR`, then give "
                f"{me!r} --set auth.key_file=DIR/{me}.key --set auth.roster=DIR/{ROSTER_FILE} "
                "(or, on a broker nobody else can reach, run unauthenticated with "
                "--set auth.open=true)"
            )
        return cls(me, _read_private(settings.key_file), read_roster(settings.roster))

    @classmethod
    def ephemeral(cls, ids: Iterable[str]) -> dict[str, Keyring]:
        """Fresh keys for `ids`, kept in memory (a simulation over a transport)."""
        private = {pid: Ed25519PrivateKey.generate() for pid in ids}
        roster = {pid: key.public_key() for pid, key in private.items()}
        return {pid: cls(pid, key, roster) for pid, key in private.items()}

    def next_seq(self) -> int:
        """A sequence number above every earlier one of this participant, across restarts (it
        starts from the wall clock in nanoseconds)."""
        with self._lock:
            self._seq = max(self._seq + 1, time.time_ns())
            return self._seq

    def sign(self, topic: str, body: bytes) -> bytes:
        return self._private.sign(_signed_bytes(topic, body))

    def verify(self, signer: str, topic: str, body: bytes, signature: bytes) -> bool:
        """Whether `signer` (a roster id) signed `body` for `topic`."""
        key = self.roster.get(signer)
        if key is None or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            key.verify(signature, _signed_bytes(topic, body))
        except InvalidSignature:
            return False
        return True


def _signed_bytes(topic: str, body: bytes) -> bytes:
    return b"".join((_DOMAIN, topic.encode(), b"\0", body))


class ReplayGuard:
    """The last sequence number accepted per topic (each topic has one writer): an older one is
    a replay, an equal one a duplicate (QoS 1 may deliver a message twice); for statuses, the
    last (incarnation, sequence number): one of an earlier incarnation is a replay, an older one
    of the same incarnation dropped quietly (the coordinator's will, signed when it connected),
    an equal one passes (a new process reads the retained status it read before). Bounded: one
    entry per topic that carried a correctly signed message.

    With a `path` it starts from what was saved there and `save()` writes it (atomically), so a
    device's new process drops what its last one already saw (a client keeps it in its state
    directory). A file that cannot be read is reported and left for the next save."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._last: dict[str, int] = {}
        self._status: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._path = Path(path) if path is not None else None
        self._dirty = False
        if self._path is not None and self._path.exists():
            self._load(self._path)

    def check(self, topic: str, kind: str, seq: int, incarnation: int = 0) -> str | None:
        """None when the message is fresh (and remember it), else "replayed" or "duplicate"."""
        if kind in UNSEQUENCED:
            return None
        with self._lock:
            if kind == "status":
                mark, last = (incarnation, seq), self._status.get(topic, (-1, -1))
                if incarnation < last[0]:
                    return "replayed"
                if mark < last:  # the same coordinator's, out of order: its will, published late
                    return "duplicate"
                # Saved when the incarnation changes, not every status (one a phase): a
                # new process needs only to know the incarnations it must not go back to.
                self._dirty |= incarnation != last[0]
                self._status[topic] = mark
                return None
            last_seq = self._last.get(topic, -1)
            if seq < last_seq:
                return "replayed"
            if seq == last_seq:
                return "duplicate"
            self._last[topic] = seq
            self._dirty = True
        return None

    def save(self) -> None:
        """Write the record to its path, when it changed since the last save."""
        with self._lock:
            if self._path is None or not self._dirty:
                return
            doc: dict[str, Any] = {
                "format": 1,
                "last": dict(self._last),
                "status": {t: list(m) for t, m in self._status.items()},
            }
            self._dirty = False
        from model_zoo.files import write_atomic  # (lazy: model_zoo imports torch; --help must not)

        write_atomic(self._path, json.dumps(doc) + "\n", mode=0o600)

    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text())
            self._last = {str(t): int(s) for t, s in doc["last"].items()}
            self._status = {str(t): (int(m[0]), int(m[1])) for t, m in doc["status"].items()}
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            log.error("the replay record %s cannot be read (%s); starting a new one", path, exc)


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def issue_keys(
    out: str | Path, clients: Iterable[str], *, coordinator: str = topics.COORDINATOR
) -> dict[str, Path]:
    """Write `OUT/<id>.key` (mode 600) for the coordinator and each client, and `OUT/roster.json`
    (their public keys). Keys already in OUT are kept, so clients can be added later; the roster
    is rewritten with every key in OUT. Returns the paths, by id (and "roster")."""
    ids = [topics.check_id(coordinator, "coordinator id")]
    ids += [topics.check_id(c, "client id") for c in clients]
    if len(set(ids)) != len(ids):
        raise ValueError(f"participant ids must be distinct (and none named {coordinator!r})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for pid in ids:
        path = out / f"{pid}.key"
        if not path.exists():
            _write_private(path, Ed25519PrivateKey.generate())
        paths[pid] = path
    public = {}
    for path in sorted(out.glob("*.key")):
        public[path.stem] = _b64(_public_raw(_read_private(path).public_key()))
    roster = out / ROSTER_FILE
    tmp = out / f".{ROSTER_FILE}.tmp"
    tmp.write_text(json.dumps({"format": 1, "keys": public}, indent=1) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, roster)
    paths["roster"] = roster
    return paths
