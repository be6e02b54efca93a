"""Retained publications: models anyone may read later, with no one answering. The chunks go
retained on numbered subtopics, the manifest that names them on the topic itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from edge_sdk.auth import Keyring
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, WireModel
from edge_sdk.model_blobs import pack_models, unpack_models
from edge_sdk.protocol import Message, ModelRef
from edge_sdk.transport.base import Transport
from edge_sdk.wire import Endpoint

__all__ = ["publish_retained", "read_retained"]

log = logging.getLogger(__name__)


def publish_retained(
    endpoint: Endpoint,
    topic: str,
    models: Mapping[str, WireModel],
    manifest: Callable[[dict[str, ModelRef]], Message],
    *,
    previous_chunks: int = 0,
) -> int:
    """Publish `models` retained on `topic`: chunks on `topic/i` (each retained), then the
    manifest `manifest(refs)` on `topic` itself, so a reader that subscribes later gets them all.
    Chunk topics left over from a longer previous publication (`previous_chunks`) are cleared.
    Returns the number of chunk topics this publication uses."""
    refs, blobs = pack_models(models, max_bytes=endpoint.max_blob_bytes)
    deliveries = endpoint.publish_blobs(topic, blobs, retain=True, chunk_topics=True)
    count = len(deliveries)
    for i in range(count, previous_chunks):
        deliveries.append(endpoint.transport.publish(f"{topic}/{i}", b"", retain=True))
    frame = endpoint.frame(topic, manifest(refs))
    deliveries.append(endpoint.transport.publish(topic, frame, retain=True))
    endpoint.wait(deliveries)
    return count


def read_retained(
    transport: Transport,
    topic: str,
    accept: Callable[[Message], bool],
    *,
    timeout: float,
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    keyring: Keyring | None = None,
) -> tuple[Message, dict[str, WireModel]] | None:
    """The first publication on `topic` whose manifest `accept`s (signed by the topic's writer,
    with a `keyring`), with its models decoded and checked, or None after `timeout` s."""
    reader = Endpoint(
        transport,
        [topic, f"{topic}/+"],
        max_blob_bytes=max_blob_bytes,
        scope=lambda _topic: topic,  # the chunks belong to the publication
        keyring=keyring,
    ).open()
    try:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            env = reader.receive(timeout=left)
            if env is None:
                break
            msg = env.message
            if env.topic != topic or not accept(msg):
                continue
            refs: dict[str, ModelRef] = getattr(msg, "models", {})
            try:
                return msg, unpack_models(refs, env.blobs, max_bytes=max_blob_bytes)
            except (ValueError, KeyError) as exc:
                log.warning("an unusable publication on %s: %s", topic, exc)
        return None
    finally:
        reader.close()
