"""The agent's memory budget: a reservation waits for its client's share and for the total,
is woken by what others give back, and never outlives its connection; images are priced from
their headers; a LOAD asking more than the operator allows is refused naming the key."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest

from dpu_agents import budget
from dpu_agents.budget import DECODE, QUEUED, Budget, Deadlines, decode_costs
from dpu_agents.config import AgentConfig
from dpu_agents.stagebuild import build_stage
from nicoffload.errors import AgentError, TransportError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan

CONFIG = AgentConfig(queued_bytes=100, queued_bytes_per_client=60, decode_bytes=10**9)


def waiter(account: budget.Account, kind: str, n: int) -> tuple[threading.Thread, list]:
    """`account.reserve(kind, n)` on a thread; what it ended with goes into the list."""
    out: list = []

    def run() -> None:
        try:
            account.reserve(kind, n, timeout=10)
            out.append("got")
        except TransportError as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.05)
    return t, out


def test_a_reservation_over_the_clients_share_waits_for_its_own_release() -> None:
    a = Budget(CONFIG).client()
    a.reserve(QUEUED, 50, timeout=1)
    t, out = waiter(a, QUEUED, 20)  # 70 > 60 for this client, though the total has room
    assert out == []
    a.release(QUEUED, 50)
    t.join(2)
    assert out == ["got"] and a.used[QUEUED] == 20


def test_a_reservation_over_the_total_waits_for_another_clients_release() -> None:
    b = Budget(CONFIG)
    first, second = b.client(), b.client()
    first.reserve(QUEUED, 60, timeout=1)
    t, out = waiter(second, QUEUED, 50)  # 110 > 100 in all, though its share has room
    assert out == []
    first.release(QUEUED, 60)
    t.join(2)
    assert out == ["got"] and b.used[QUEUED] == 50


def test_most_is_the_smaller_of_the_share_and_the_total() -> None:
    account = Budget(CONFIG).client()
    assert account.most(QUEUED) == 60
    assert account.most(DECODE) == CONFIG.decode_bytes_per_client


def test_a_waiting_reservation_ends_when_the_connection_goes() -> None:
    a = Budget(CONFIG).client()
    a.reserve(QUEUED, 60, timeout=1)
    t, out = waiter(a, QUEUED, 10)
    a.cancel()
    t.join(2)
    assert isinstance(out[0], TransportError) and "closing" in str(out[0])


def test_a_reservation_that_never_fits_in_time_fails() -> None:
    a = Budget(CONFIG).client()
    a.reserve(QUEUED, 60, timeout=1)
    with pytest.raises(TransportError, match=r"waited 0\.1 s"):
        a.reserve(QUEUED, 1, timeout=0.1)


def test_close_gives_everything_back_once() -> None:
    b = Budget(CONFIG)
    a = b.client()
    a.reserve(QUEUED, 40, timeout=1)
    assert a.take(budget.BATCH, 1000)
    a.close()
    assert b.used == dict.fromkeys(budget.KINDS, 0)
    a.release(QUEUED, 40)  # the session's late release after the connection closed
    assert b.used[QUEUED] == 0
    assert not a.take(QUEUED, 1)


def test_a_late_read_is_called_and_a_disarmed_one_is_not() -> None:
    d, called = Deadlines(), []
    d.arm(1, time.monotonic() + 0.05, lambda: called.append(1))
    d.arm(2, time.monotonic() + 0.05, lambda: called.append(2))
    d.disarm(2)
    time.sleep(0.4)
    assert called == [1]


# --- images priced from their headers ----------------------------------------------------------


def image(fmt: str, h: int, w: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (w, h)).save(buf, fmt)
    return buf.getvalue()


def built_for(tmp_path, color: str = "rgb", resize: str = "size: [8, 8], antialias: false"):
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: p\ninputs: {image: {kind: bytes, format: jpeg}}\nnodes:\n"
        f"  - {{name: decode, op: decode_image, in: image, params: {{color: {color}, "
        "max_pixels: 1000000}}\n"
        f"  - {{name: resize, op: resize, in: decode, params: {{{resize}}}}}\n"
        "outputs: {pixels: resize}\n"
    )
    plan = single_device_plan(load_pipeline(path), "dpu0")
    return build_stage(path.read_text(), json.dumps(plan.to_json()), plan.stages[0].name, 4, 1)


def test_a_jpeg_is_priced_from_its_header_with_the_resize_after_it(tmp_path) -> None:
    cost = decode_costs(built_for(tmp_path))
    assert cost({"image": image("JPEG", 600, 800)}) == 600 * 800 * 3 + 8 * 8 * 3
    gray = decode_costs(built_for(tmp_path, "gray"))
    assert gray({"image": image("JPEG", 600, 800)}) == 600 * 800 + 8 * 8


def test_a_dct_scaled_decode_is_priced_at_the_size_it_decodes_to(tmp_path) -> None:
    cost = decode_costs(built_for(tmp_path, resize="size: [50, 50], antialias: true"))
    assert cost({"image": image("JPEG", 800, 800)}) == 200 * 200 * 3 + 50 * 50 * 3  # at 1/4


def test_a_png_is_priced_with_pillows_own_copies(tmp_path) -> None:
    cost = decode_costs(built_for(tmp_path))
    assert cost({"image": image("PNG", 100, 200)}) == 100 * 200 * (8 + 4 + 3) + 8 * 8 * 3


def test_what_the_kernel_refuses_from_its_header_costs_nothing(tmp_path) -> None:
    cost = decode_costs(built_for(tmp_path))
    assert cost({"image": b"not an image at all"}) == 0
    assert cost({"image": image("JPEG", 1200, 1000)}) == 0  # over max_pixels: refused unread


# --- what a LOAD may ask ---------------------------------------------------------------------


def load(tmp_path, decode: str = "", size: int = 8, batch: int = 4, **limits) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: p\ninputs: {image: {kind: bytes, format: jpeg}}\nnodes:\n"
        f"  - {{name: decode, op: decode_image, in: image, params: {{color: rgb{decode}}}}}\n"
        f"  - {{name: resize, op: resize, in: decode, params: {{size: [{size}, {size}]}}}}\n"
        "outputs: {pixels: resize}\n"
    )
    plan = single_device_plan(load_pipeline(path), "dpu0")
    cfg = AgentConfig(**limits)
    build_stage(path.read_text(), json.dumps(plan.to_json()), plan.stages[0].name, batch, 1, cfg)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"decode": ", max_pixels: 50000000"},
            "<pipeline of the LOAD>:4:6: node 'decode': max_pixels 50000000 is more than this "
            "agent allows (max_pixels = 40000000)",
        ),
        (
            {"size": 2000, "max_value_bytes": 1 << 20},
            "<pipeline of the LOAD>:5:6: node 'resize': its out value (uint8[2000,2000,3] hwc) "
            "is 12000000 bytes an item, more than this agent allows (max_value_bytes = 1048576)",
        ),
        ({"batch": 2000}, "batch_max_size 2000 is more than this agent allows (max_batch = 1024)"),
        (
            {"size": 100, "batch": 100, "max_slot_bytes": 1 << 20},
            "a batch of 100 of the stage's outputs is 3000000 bytes, more than this agent "
            "allows (max_slot_bytes = 1048576)",
        ),
    ],
    ids=["max_pixels", "max_value_bytes", "max_batch", "max_slot_bytes"],
)
def test_a_load_over_the_operators_bounds_is_refused_naming_the_key(tmp_path, kw, message):
    with pytest.raises(AgentError) as info:
        load(tmp_path, **kw)
    assert message in str(info.value)


def test_a_load_within_the_bounds_is_built(tmp_path) -> None:
    load(tmp_path, decode=", max_pixels: 1000", size=100, batch=100)
