"""Reply.details: per-client facts cross the wire as they are, within bounds."""

import pytest

from edge_sdk.protocol import ProtocolError, Reply, decode, encode


def _reply(details):
    return Reply(
        run="r", sender="c0", task_id="t", round=1, phase="finalize", ok=True, details=details
    )


def test_reply_details_round_trip_with_their_types():
    details = {"teacher_round": 3, "distill_T": 4.0, "arch_end": "mlp", "adopted": True, "x": None}
    got = decode(encode(_reply(details)))
    assert got.details == details
    assert [type(v) for v in got.details.values()] == [int, float, str, bool, type(None)]


@pytest.mark.parametrize(
    "details", [{"nested": {"a": 1}}, {"long": "x" * 257}, {f"k{i}": i for i in range(65)}]
)
def test_reply_details_refuse_nesting_and_oversized_values(details):
    raw = encode(_reply({})).replace(b'"details":{}', b'"details":' + _json(details))
    with pytest.raises(ProtocolError):
        decode(raw)


def _json(obj) -> bytes:
    import json

    return json.dumps(obj).encode()
