"""Python values the tests' corpora do not use, as `values_items` hands them to every placement:
an encoded file given as a 1-D uint8 array goes on as bytes (a memoryview of it), so a decode on
the agent reads it as the host's decoder does (it went as a tensor, and the agent failed the
item as bad_request where the host decoded it)."""

from __future__ import annotations

import numpy as np

import nicoffload
from nicoffload.agent.protocol import BYTES, _signature
from nicoffload.inputs import values_items

RESNET = nicoffload.load_pipeline("pipelines/resnet50.yaml")
CLIP = nicoffload.load_pipeline("pipelines/clip.yaml")


def test_a_uint8_array_for_an_image_goes_on_as_bytes() -> None:
    jpeg = b"\xff\xd8\xff\xe0 not really a jpeg"
    arr = np.frombuffer(jpeg, np.uint8).copy()
    items = list(values_items(RESNET, [arr, {"image": arr}, ("named", {"image": arr[::1]})]))
    assert [name for name, _ in items] == ["0", "1", "named"]
    for _, values in items:
        assert isinstance(values["image"], memoryview) and bytes(values["image"]) == jpeg
        assert _signature(values) == (("image", BYTES, 0, 0),)  # what the agent reads as bytes


def test_other_values_pass_unchanged() -> None:
    odd = np.zeros((2, 3), np.uint8)  # not an encoded file: the decoder says what it is
    items = list(values_items(CLIP, [{"image": odd, "text": "a"}, {"image": b"x", "text": "b"}]))
    assert items[0][1]["image"] is odd
    item = {"image": b"x", "text": "b"}
    assert next(iter(values_items(CLIP, [item])))[1] is item  # nothing copied when none is


def test_a_text_where_an_image_is_read_fails_its_item_as_on_an_agent() -> None:
    import pytest

    from nicoffload.errors import ItemError
    from nicoffload.ops.decode import decode_image_cpu

    decode = decode_image_cpu([RESNET.node("decode")], ())
    with pytest.raises(ItemError) as err:  # a TypeError before, which failed the whole run
        decode("not an image")
    assert err.value.reason == "bad_request"  # the agent's reason for a text where it reads bytes


def test_a_png_pillow_cannot_identify_fails_with_a_detail_that_names_no_address() -> None:
    import pytest

    from nicoffload.errors import ItemError
    from nicoffload.ops.decode import _decode_png

    with pytest.raises(ItemError) as err:
        _decode_png(b"\x89PNG\r\n\x1a\n" + bytes(25), "rgb", 1 << 20)  # a header and no more
    assert err.value.reason == "corrupt"
    assert err.value.detail == "png: cannot identify image file"
