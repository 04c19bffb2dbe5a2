"""Finding the field of an encoded request that is not UTF-8, to name it in the refusal."""

from __future__ import annotations

from baton.v1 import router_pb2
from services.common.request_decoding import bad_utf8_field


def test_the_field_that_is_not_utf8_is_found_in_the_encoded_request() -> None:
    encoded = router_pb2.GenerateRequest(model="m", prompt="héllo", stop=["ok", "no"],
                                         resume=router_pb2.Resume(token_ids=[1, 2])).SerializeToString()
    descriptor = router_pb2.GenerateRequest.DESCRIPTOR
    assert bad_utf8_field(encoded, descriptor) is None
    assert bad_utf8_field(encoded.replace("é".encode(), b"\xff\xfe"), descriptor) == ("prompt", b"h\xff\xfello", 1)
    assert bad_utf8_field(encoded.replace(b"no", b"n\xc3"), descriptor) == ("stop[1]", b"n\xc3", 1)
    assert bad_utf8_field(b"\x12\xff", descriptor) is None  # truncated: no field to name
