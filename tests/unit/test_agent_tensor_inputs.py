"""Tensors in a REQUEST: an ndarray travels as its C-order bytes with its dtype and shape, and
comes back on the agent as the same ndarray, a view of the payload where it is aligned. A
frame whose shapes lie is a frame error before its payload is read; a tensor that does not
match what the stage reads (its TensorSpec, its bounds) fails its item alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dpu_agents.budget import decode_costs
from dpu_agents.config import AgentConfig
from dpu_agents.ingress import check_requests_fit
from dpu_agents.stagebuild import build_stage
from dpu_agents.stageinputs import check_values
from nicoffload.agent.protocol import (
    BYTES,
    MAX_NDIM,
    MAX_SHAPE_DIMS,
    TENSOR,
    VALUE_ALIGN,
    RequestMeta,
    request_frames,
    request_sizes,
    split_request,
)
from nicoffload.errors import AgentError, FrameError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import Plan, stages_for
from nicoffload.transport.frame import HEADER_SIZE, DType, Header, Kind, decode_meta

RESNET = Path(__file__).resolve().parents[2] / "pipelines" / "resnet50.yaml"
YAML = RESNET.read_text()
ITEMS = [
    {
        "image": b"\xff\xd8" + bytes([i]) * (3 + i),  # odd lengths: the next value is padded
        "decode": np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3) + i,
        "ids": np.arange(9, dtype=np.int64) * (i + 1),
        "pixels": np.full((3, 2, 2), i, np.float16),
        "scalar": np.array(i + 0.5),
        "mask": np.array([True, False, i % 2 == 0]),
        "caption": f"item {i}",
    }
    for i in range(4)
]


def parsed(blob: bytes) -> tuple[Header, RequestMeta]:
    header = Header.unpack(blob)
    return header, decode_meta(blob[HEADER_SIZE : HEADER_SIZE + header.meta_len], RequestMeta)


def round_trip(items, payload_offset: int = 0) -> list[dict]:
    ((_, head, parts),) = request_frames(1, items, 1 << 20)
    header, meta = parsed(head)
    body = b"".join(bytes(p) for p in parts)
    assert len(body) == header.payload_len
    buf = np.zeros(len(body) + payload_offset, np.uint8)  # as the agent reads it: np.empty
    buf[payload_offset:] = np.frombuffer(body, np.uint8)
    return split_request(meta, request_sizes(header, meta), memoryview(buf)[payload_offset:])


def test_tensors_arrive_with_their_dtype_and_shape_as_views_of_the_payload() -> None:
    got = round_trip(ITEMS)
    for want, have in zip(ITEMS, got, strict=True):
        assert bytes(have["image"]) == want["image"] and have["caption"] == want["caption"]
        for key in ("decode", "ids", "pixels", "scalar", "mask"):
            a = have[key]
            assert (a.dtype, a.shape) == (want[key].dtype, want[key].shape)
            np.testing.assert_array_equal(a, want[key])
            assert a.base is not None and a.flags.aligned  # a view, no copy
            assert a.flags.writeable  # numba compiles again, for seconds, for a read-only one


def test_items_whose_only_tensors_are_scalars_arrive() -> None:
    """No dims at all in the frame (every tensor 0-dim): each item still has its scalar."""
    got = round_trip([{"scalar": np.array(i + 0.5)} for i in range(3)])
    assert [float(v["scalar"]) for v in got] == [0.5, 1.5, 2.5]
    assert all(v["scalar"].shape == () for v in got)


def test_a_text_with_a_lone_surrogate_arrives_as_itself() -> None:
    """So the stage fails that item as the host does (bad_text), not a text with U+FFFD."""
    (got,) = round_trip([{"caption": "abc\udcffdef"}])
    assert got["caption"] == "abc\udcffdef"


def test_every_value_starts_at_an_aligned_offset() -> None:
    ((_, head, _),) = request_frames(1, ITEMS[:1], 1 << 20)
    header, meta = parsed(head)
    lengths = np.frombuffer(meta.lengths, "<u4")
    offsets = np.cumsum([0, *(-(-lengths // VALUE_ALIGN) * VALUE_ALIGN)])
    assert not (offsets % VALUE_ALIGN).any() and offsets[-1] == header.payload_len


def test_a_misaligned_payload_gives_copies_of_the_same_values() -> None:
    got = round_trip(ITEMS, payload_offset=1)
    for want, have in zip(ITEMS, got, strict=True):
        np.testing.assert_array_equal(have["ids"], want["ids"])
        assert have["ids"].flags.aligned and have["ids"].dtype == np.int64


def test_a_non_contiguous_tensor_is_sent_in_c_order() -> None:
    chw = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
    hwc = chw.transpose(1, 2, 0)  # a view, not C-contiguous
    (got,) = round_trip([{"x": hwc}])
    assert got["x"].shape == (4, 5, 3)
    np.testing.assert_array_equal(got["x"], hwc)


def test_the_meta_declares_kind_dtype_ndim_per_input_and_shapes_per_item() -> None:
    ((_, head, _),) = request_frames(1, [{"a": b"x", "t": np.zeros((2, 3), np.float32)}] * 2, 99)
    _, meta = parsed(head)
    assert (meta.kinds, meta.dtypes, meta.ndims) == ((BYTES, TENSOR), (0, DType.FLOAT32), (0, 2))
    assert np.frombuffer(meta.shapes, "<u4").tolist() == [2, 3, 2, 3]


def test_frames_are_cut_so_their_shapes_stay_within_max_shape_dims() -> None:
    items = [{"t": np.zeros((1,) * MAX_NDIM, np.uint8)} for _ in range(MAX_SHAPE_DIMS // 8 + 3)]
    frames = list(request_frames(1, items, 1 << 30))
    assert [n for n, _, _ in frames] == [MAX_SHAPE_DIMS // MAX_NDIM, 3]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (np.zeros((2, 0, 3), np.uint8), "cannot be sent"),  # a dim of 0
        (np.zeros((1,) * (MAX_NDIM + 1), np.uint8), "cannot be sent"),  # too many dims
        (np.array(["a"], object), "cannot be sent"),
        (np.zeros(3, ">f4"), "cannot be sent"),  # not little-endian
        (np.zeros(3, np.complex64), "cannot be sent"),
    ],
)
def test_a_tensor_the_wire_cannot_carry_is_refused_before_any_frame(value, why) -> None:
    frames = request_frames(1, [{"t": np.zeros(2, np.uint8)}, {"t": value}], 1 << 20)
    with pytest.raises(ValueError, match=why):
        next(frames)  # not even the first item's frame: nothing of the batch goes


# --- frames that lie about their tensors -----------------------------------------------------


def tensor_frame(shape=(2, 3), dtype="<f4", length=None, ndim=None, code=None, n=1) -> tuple:
    """Header and meta of a REQUEST of `n` items of one tensor input, each declaring `shape`
    and `length` (by default what the shape implies)."""
    size = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    length = size if length is None else length
    meta = RequestMeta(
        ("t",),
        (TENSOR,),
        (int(DType.of(dtype)) if code is None else code,),
        (len(shape) if ndim is None else ndim,),
        np.full(n, length, "<u4").tobytes(),
        np.tile(np.asarray(shape, "<u4"), n).tobytes(),
    )
    padded = -(-length // VALUE_ALIGN) * VALUE_ALIGN
    return Header(Kind.REQUEST, request_id=1, batch_size=n, payload_len=n * padded), meta


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (tensor_frame(length=20), r"shape \(2, 3\) of float32 is 24 bytes, but its length is 20"),
        (tensor_frame(shape=(2, 0, 3), length=0), "a dim of 0"),
        (tensor_frame(shape=(1,) * (MAX_NDIM + 1)), "meta: input 't'"),  # ndim past MAX_NDIM
        # a product past 2**64 that would wrap to the length if it were computed in int64
        (tensor_frame(shape=(2**32 - 1,) * 4, length=8), "but its length is 8"),
        (tensor_frame(shape=(65536, 65536), dtype="u1", length=0), "but its length is 0"),
        (tensor_frame(code=99), "meta: input 't'"),  # no such dtype
        (tensor_frame(code=0), "meta: input 't'"),  # a tensor of raw bytes
        (tensor_frame(ndim=1), "batch_size"),  # 2 dims declared in shapes, 1 in ndims
        (tensor_frame(shape=(1,) * 8, n=MAX_SHAPE_DIMS // 8 + 1), "batch_size"),
    ],
)
def test_a_frame_whose_tensors_lie_is_a_frame_error_before_its_payload_is_read(frame, why):
    with pytest.raises(FrameError, match=f"malformed frame: .*{why}"):
        request_sizes(*frame)


def test_bytes_that_declare_a_shape_are_a_frame_error() -> None:
    header, meta = tensor_frame()
    lying = RequestMeta(meta.names, (BYTES,), (0,), (2,), meta.lengths, meta.shapes)
    with pytest.raises(FrameError, match="meta: input 't'"):
        request_sizes(header, lying)


def test_an_honest_tensor_frame_passes_and_its_sizes_are_the_lengths() -> None:
    header, meta = tensor_frame(shape=(3, 5), dtype="<u2", n=4)
    assert request_sizes(header, meta).tolist() == [[30]] * 4


# --- a stage that reads another stage's values ----------------------------------------------


def plan_of(placement: dict[str, str]) -> Plan:
    pipeline = load_pipeline(RESNET)
    stages, transfers = stages_for(pipeline, placement)
    return Plan(pipeline.name, placement, stages, transfers)


HOST_DPU = {"decode": "cpu", "resize": "dpu0", "crop": "dpu0", "norm": "dpu0"}


def built_of(placement=HOST_DPU, limits=None):
    plan = plan_of(placement)
    stage = next(s for s in plan.stages if s.kind == "dpu")
    return build_stage(YAML, json.dumps(plan.to_json()), stage.name, 4, 1.0, limits)


def test_a_stage_reading_the_hosts_decoded_image_loads_and_says_what_it_reads() -> None:
    built = built_of(limits=AgentConfig(max_pixels=1_000_000))
    (inp,) = built.inputs.values()
    assert (inp.key, inp.kind, str(inp.spec)) == ("decode", "tensor", "uint8[H,W,3] hwc")
    assert inp.max_pixels == 1_000_000  # the agent's bound, lower than the decoder's
    assert list(built.out_specs) == ["norm"]
    check_requests_fit(built.inputs)


def test_a_dpu_stage_between_host_stages_and_after_one_loads() -> None:
    # DPU -> host -> DPU: the second DPU stage reads the host's resize (dynamic dims)
    plan = plan_of({"decode": "dpu0", "resize": "cpu", "crop": "dpu0", "norm": "dpu0"})
    built = build_stage(YAML, json.dumps(plan.to_json()), plan.stages[-1].name, 4, 1.0)
    assert list(built.inputs) == ["resize"] and built.inputs["resize"].max_pixels == 0


def image(h=300, w=400, c=3, dtype=np.uint8) -> np.ndarray:
    return np.zeros((h, w, c), dtype)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (image(dtype=np.float32), r"must be uint8\[H,W,3\] hwc, got float32"),
        (image(c=4), r"got uint8\[300, 400, 4\] \(dim 2\)"),  # a static dim differs
        (np.zeros((300, 400), np.uint8), r"must be uint8\[H,W,3\]"),  # a dim short
        (memoryview(b"\xff\xd8 jpeg bytes"), "must be tensor"),  # bytes where a tensor is read
        ("text", "must be tensor"),
        (image(2000, 1000), "1000x2000 pixels is more than max_pixels=1000000"),
    ],
)
def test_a_tensor_that_does_not_match_what_the_stage_reads_fails_its_item(value, why) -> None:
    built = built_of(limits=AgentConfig(max_pixels=1_000_000))
    check_values(built.inputs, {"decode": image()})  # the right one passes
    with pytest.raises(ValueError, match=why):
        check_values(built.inputs, {"decode": value})


def test_a_tensor_past_max_value_bytes_fails_its_item() -> None:
    built = built_of(limits=AgentConfig(max_value_bytes=300 * 400 * 3))
    check_values(built.inputs, {"decode": image()})
    with pytest.raises(ValueError, match="max_value_bytes = 360000"):
        check_values(built.inputs, {"decode": image(301)})


def test_a_tensor_where_bytes_are_read_fails_its_item() -> None:
    built = built_of({n: "dpu0" for n in HOST_DPU})  # the leading stage: it reads the JPEG
    with pytest.raises(ValueError, match=r"input 'image' must be bytes .* got tensor"):
        check_values(built.inputs, {"image": np.frombuffer(b"\xff\xd8", np.uint8)})


def test_missing_or_extra_values_fail_the_item() -> None:
    built = built_of()
    with pytest.raises(ValueError, match=r"inputs \['decode', 'image'\], the stage reads"):
        check_values(built.inputs, {"decode": image(), "image": memoryview(b"x")})
    with pytest.raises(ValueError, match=r"inputs \[\], the stage reads \['decode'\]"):
        check_values(built.inputs, {})


def test_the_decode_budget_counts_the_resize_of_a_carried_image() -> None:
    built = built_of()
    cost = decode_costs(built)
    assert cost({"decode": image(300, 400)}) == 256 * 341 * 3  # shorter side to 256


def test_a_static_input_larger_than_the_agent_allows_is_refused_at_load() -> None:
    # norm's input is crop's 224x224x3 uint8: 150528 bytes an item
    placement = {"decode": "cpu", "resize": "cpu", "crop": "cpu", "norm": "dpu0"}
    plan, limits = plan_of(placement), AgentConfig(max_value_bytes=150_000)
    with pytest.raises(AgentError, match=r"reads 'crop'.*max_value_bytes = 150000"):
        build_stage(YAML, json.dumps(plan.to_json()), plan.stages[-1].name, 4, 1.0, limits)
