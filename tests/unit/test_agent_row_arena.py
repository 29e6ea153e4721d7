"""Outputs of varying shape on the agent (`rowarena.RowArena`): a batch's rows live in one buffer
kept from batch to batch, its bytes taken from the agent's ARENA budget; rows that do not fit get
fresh arrays, counted, and the buffer grows to what the batch needed at its next batch. A kernel
that takes an allocator (the decoder) writes its output there directly; a stage copies any other
kernel's result there (`Stage.process` with an `ops.Alloc` destination)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from kernel_contract import make_chain
from PIL import Image

from dpu_agents.budget import ARENA, Budget
from dpu_agents.config import AgentConfig
from dpu_agents.rowarena import RowArena
from nicoffload.graph import Dim, TensorSpec, load_pipeline
from nicoffload.ops import get_kernel
from nicoffload.planner.plan import StagePlan
from nicoffload.runtime.stage import Stage

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def budget(total: int = 64 * MIB, most: int = 8 * MIB) -> Budget:
    return Budget(AgentConfig(arena_bytes=total, max_arena_bytes=most, arena_keep_bytes=MIB))


def image(h: int, w: int, seed: int = 0, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    px = rng.integers(0, 255, (h // 8, w // 8, 3), np.uint8).repeat(8, 0).repeat(8, 1)
    buf = io.BytesIO()
    Image.fromarray(px).convert(mode).save(buf, fmt)
    return buf.getvalue()


def test_the_first_batch_gets_fresh_arrays_and_the_next_one_rows_in_the_buffer() -> None:
    b = budget()
    arena = RowArena(b, b.arena_most)
    first = [arena.put(np.full((100, 100, 3), i, np.uint8)) for i in range(3)]
    assert arena.size == 0 and arena.fresh == 3
    arena.reset()  # grown to what the first batch asked for
    assert arena.size >= 3 * 30_000 and b.used[ARENA] == arena.size
    rows = [arena.put(np.full((100, 100, 3), 10 + i, np.uint8)) for i in range(3)]
    assert arena.fresh == 3  # none more
    assert all(np.shares_memory(r, arena.buf) for r in rows)
    assert [int(r[0, 0, 0]) for r in rows] == [10, 11, 12]
    assert [int(r[50, 50, 2]) for r in first] == [0, 1, 2]
    assert not any(np.shares_memory(r, s) for i, r in enumerate(rows) for s in rows[i + 1 :])


def test_rows_start_on_cache_lines_and_keep_their_dtype_and_shape() -> None:
    arena = RowArena(None, 8 * MIB)
    arena.put(np.zeros(4096, np.uint8))
    arena.reset()
    a = arena.alloc((3, 5), np.float32)
    c = arena.alloc((7,), np.uint8)
    assert a.shape == (3, 5) and a.dtype == np.float32 and c.shape == (7,)
    assert (a.ctypes.data - arena.buf.ctypes.data) % 64 == 0
    assert (c.ctypes.data - arena.buf.ctypes.data) % 64 == 0
    assert c.ctypes.data >= a.ctypes.data + a.nbytes


def test_the_buffer_never_grows_past_most_nor_past_the_budget() -> None:
    b = budget(total=4 * MIB, most=8 * MIB)
    arena = RowArena(b, b.arena_most)
    arena.alloc((6 * MIB,), np.uint8)  # the budget has 4 MiB in all
    arena.reset()
    assert arena.size == 0 and b.used[ARENA] == 0
    arena.alloc((6 * MIB,), np.uint8)
    assert arena.fresh == 2
    small = RowArena(budget(), 1 * MIB)
    small.alloc((2 * MIB,), np.uint8)
    small.reset()
    assert small.size == 0  # over `most`: fresh arrays, counted
    small.alloc((2 * MIB,), np.uint8)
    assert small.fresh == 2


def test_close_gives_the_buffer_back_to_the_budget() -> None:
    b = budget()
    arena = RowArena(b, b.arena_most)
    arena.alloc((3 * MIB,), np.uint8)
    arena.reset()
    assert b.used[ARENA] == 3 * MIB
    arena.close()
    assert b.used[ARENA] == 0 and arena.size == 0


def decoder():
    spec = TensorSpec("bytes", (Dim("nbytes", 1000),))
    return get_kernel("decode_image", "cpu").build(make_chain(("decode_image",), [{}], spec), ())


@pytest.mark.parametrize(
    "data",
    [image(48, 64), image(40, 56, fmt="PNG"), image(48, 64, mode="CMYK")],
    ids=["jpeg", "png", "cmyk-jpeg"],
)
def test_the_decoder_writes_into_what_the_allocator_gives(data: bytes) -> None:
    decode = decoder()
    want = decode(data).copy()
    arena = RowArena(None, 8 * MIB)
    arena.alloc((MIB,), np.uint8)
    arena.reset()
    got = decode(data, out=arena.alloc)
    assert np.shares_memory(got, arena.buf)
    assert np.array_equal(got, want)
    decode(image(48, 64, seed=1))  # its scratch buffer reused: the row stays
    assert np.array_equal(got, want)


@pytest.fixture(scope="module")
def stage() -> Stage:
    pipeline = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    return Stage(pipeline, StagePlan("s0-dpu0", "dpu0", "dpu", ("decode", "resize")), {"resize"})


def test_a_stage_copies_a_kernel_result_into_an_allocated_row(stage: Stage) -> None:
    """The resize kernel takes no allocator: its result is copied into the arena, and the
    output counts as written."""
    data = image(400, 560)
    alone: dict = {"image": data}
    stage.process(alone, {})
    arena = RowArena(None, 8 * MIB)
    arena.alloc((2 * MIB,), np.uint8)
    arena.reset()
    values: dict = {"image": data}
    written = stage.process(values, {"resize": arena.alloc})
    assert written == ["resize"]
    assert np.shares_memory(values["resize"], arena.buf)
    assert np.array_equal(values["resize"], alone["resize"])


def test_nothing_is_taken_once_closed() -> None:
    """A batcher that outlives its session's close takes no budget when it resets a slot."""
    b = budget()
    arena = RowArena(b, b.arena_most)
    arena.alloc((3 * MIB,), np.uint8)
    arena.close()
    arena.reset()
    assert b.used[ARENA] == 0 and arena.size == 0
    row = arena.alloc((10,), np.uint8)  # a fresh array, counted
    assert row.shape == (10,) and arena.fresh == 2


def test_an_initial_size_is_taken_from_the_budget_at_once_and_the_first_batch_fits() -> None:
    b = budget()
    arena = RowArena(b, b.arena_most, initial=3 * 30_000 + 1)  # a typical batch's rows
    assert arena.size == MIB and b.used[ARENA] == MIB  # whole MiB, from the budget now
    rows = [arena.put(np.full((100, 100, 3), i, np.uint8)) for i in range(3)]
    assert arena.fresh == 0 and all(np.shares_memory(r, arena.buf) for r in rows)
    arena.close()
    assert b.used[ARENA] == 0
    # capped at `most`; none when the budget has not the bytes (rows then get fresh arrays)
    assert RowArena(None, 2 * MIB, initial=5 * MIB).size == 2 * MIB
    tight = budget(total=MIB, most=8 * MIB)
    assert RowArena(tight, 8 * MIB, initial=2 * MIB).size == 0 and tight.used[ARENA] == 0
