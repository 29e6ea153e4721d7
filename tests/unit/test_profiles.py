"""Profiles: the JSON they are written in, the shipped estimates, and where the planner finds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nicoffload.errors import ProfileError
from nicoffload.profiles import (
    KernelCost,
    LinkCost,
    Profile,
    default_profile_for,
    load_profile,
    profile_path,
    shipped_names,
)


def test_a_profile_round_trips_through_json(tmp_path: Path) -> None:
    p = Profile(
        "cpu",
        {"decode_image": KernelCost(0.1, 6e-6, "pixels", ((1000.0, 0.106),))},
        {"tcp": LinkCost(0.03, 2.5e9, 0.25, 40.0), "shm": LinkCost(0.01, 1e10, 0.05)},
        {"cpu": "test"},
        "2026-01-01",
        "measured: test",
    )
    p.save(tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.kernel("decode_image") == p.kernels["decode_image"]
    assert back.kernel(("decode_image",)).ms(1000) == pytest.approx(0.106)
    assert back.links == p.links and back.method == "measured: test"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"format": "other"}, "not a nicoffload profile"),
        ({"format": "nicoffload-profile", "version": 9, "kind": "cpu"}, "version 9"),
        ({"format": "nicoffload-profile", "version": 1, "kind": "tpu"}, "'kind' must be"),
        (
            {
                "format": "nicoffload-profile",
                "version": 1,
                "kind": "cpu",
                "kernels": {"resize": {"a_ms": -1, "b_ms": 0}},
            },
            "kernel 'resize': 'a_ms' must be a number >= 0",
        ),
    ],
)
def test_a_malformed_profile_says_what_is_wrong(tmp_path: Path, doc, message) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert info.value.exit_code == 2


def test_a_profile_that_is_not_json_points_at_the_mistake(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"format":\n  nope}')
    with pytest.raises(ProfileError, match=r"p\.json:2:3: not JSON"):
        load_profile(path)


@pytest.mark.parametrize("name", ["x86-server", "bluefield3-arm", "bluefield2-arm", "h100", "a100"])
def test_shipped_estimates_say_they_are_estimates_and_on_what_basis(name: str) -> None:
    assert name in shipped_names()
    p = load_profile(profile_path(name))
    assert p.method.startswith("estimate:")
    assert "nicoffload profile" in p.method  # how to measure the real one
    assert len(p.basis) > 80
    assert p.kernel("decode_image") is not None


def test_arm_cores_are_estimated_slower_than_x86_cores() -> None:
    x86, bf3, bf2 = (
        load_profile(profile_path(n)) for n in ("x86-server", "bluefield3-arm", "bluefield2-arm")
    )
    for op in ("decode_image", "resize", "normalize", "tokenize"):
        w = 100_000
        assert x86.kernel(op).ms(w) < bf3.kernel(op).ms(w) < bf2.kernel(op).ms(w)


def test_an_unknown_profile_name_lists_the_shipped_ones() -> None:
    with pytest.raises(LookupError, match="bluefield3-arm"):
        profile_path("bluefield9")


def test_this_machines_measured_profile_wins_over_the_shipped_estimate(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("NICOFFLOAD_PROFILES", str(tmp_path))
    assert default_profile_for("cpu").endswith("x86-server.json")
    Profile("cpu", {}).save(tmp_path / "cpu.json")
    assert default_profile_for("cpu") == str(tmp_path / "cpu.json")
    assert default_profile_for("dpu").endswith("bluefield3-arm.json")


def test_fit_recovers_a_line_and_never_goes_negative() -> None:
    from nicoffload.profiling import fit

    assert fit([(0, 1.0), (10, 3.0), (20, 5.0)]) == pytest.approx((1.0, 0.2))
    a, b = fit([(10, 1.0), (20, 5.0)])  # would cross zero below: forced through the origin
    assert a == 0.0 and b > 0
    assert fit([(5, 2.0)]) == (2.0, 0.0)


def test_measuring_runs_every_registered_kernel_and_writes_a_loadable_profile(
    tmp_path: Path, monkeypatch
) -> None:
    from nicoffload import ops, profiling, profiling_serial

    if "cpu" not in ops.kernels_for("decode_image"):
        pytest.skip("the image kernels for cpu are not registered")
    monkeypatch.setattr(profiling, "IMAGE_SIZES", ((60, 80), (120, 160), (180, 240)))
    monkeypatch.setattr(profiling, "TOKEN_LENGTHS", (8, 16))
    monkeypatch.setattr(profiling, "measure_links", lambda quick: {"tcp": LinkCost(0.01, 1e9, 0.2)})
    # the agent's runtime is measured through a real agent process: tests/integration
    monkeypatch.setattr(profiling, "measure_agent_runtime", lambda link, quick: (12.5, 300.0))
    # the host's serial time through the real runtime, on fewer items
    monkeypatch.setattr(profiling_serial, "QUICK_SERIAL_ITEMS", 512)
    monkeypatch.setattr(profiling_serial, "QUICK_SERIAL_ROUNDS", 1)
    seen = []
    p = profiling.measure(
        "cpu",
        quick=True,
        progress=lambda total=None, advance=0: seen.append((total, advance)),
        budget_s=0.02,  # what a profile holds, not its precision: 20 ms a kernel, not 250
    )
    expect = {"+".join(k.ops) for k in ops.all_kernels() if k.device == "cpu"}
    assert set(p.kernels) == expect
    assert all(len(c.points) >= 2 and c.a_ms >= 0 and c.b_ms >= 0 for c in p.kernels.values())
    assert p.method.startswith("measured:") and p.machine["cores"] >= 1 and p.date
    # sizes x (qualities, and progressive at 90), and texts
    cases = 3 * (2 + len(profiling.DECODE_QUALITIES)) + 2
    assert seen[0][0] == cases * len(expect) and sum(a for _, a in seen) == seen[0][0]
    # the decoder alone is timed at every quality, each point with its file's mean bytes
    decode = p.kernels["decode_image"].points
    assert len(decode) == 3 * (1 + len(profiling.DECODE_QUALITIES))
    # and the same photos as progressive JPEGs: not points of the fit, their time's ratio
    assert p.kernels["decode_image"].progressive_x is not None  # libjpeg-turbo: about 3x
    assert all(len(pt) == 3 and pt[2] > 0 for pt in decode)
    assert all(len(pt) == 2 for pt in p.kernels["resize"].points)
    assert len(p.kernels["resize"].points) == 3
    assert p.agent_us_per_item == 12.5 and p.agent_us_per_batch == 300.0
    p.save(tmp_path / "cpu.json")
    back = load_profile(tmp_path / "cpu.json")
    assert back.kernels.keys() == p.kernels.keys()
    assert back.agent_us_per_item == 12.5 and back.agent_us_per_batch == 300.0
    assert back.serial_us_per_item == p.serial_us_per_item > 0
    assert back.serial_us_per_batch == p.serial_us_per_batch >= 0
    assert back.serial_general_us_per_item == p.serial_general_us_per_item > 0
    assert "host serial (GIL-held) time per item" in back.method
    assert back.kernels["decode_image"].c_ms == pytest.approx(
        p.kernels["decode_image"].c_ms, rel=1e-4
    )


def test_profiling_keeps_every_worker_busy_each_item_in_its_own_buffers() -> None:
    import threading

    from nicoffload import kerneltime
    from nicoffload.graph import TensorSpec

    calls = []
    lock = threading.Lock()

    def kernel(data, out=None):
        with lock:
            calls.append((threading.get_ident(), id(data), id(out)))
        out[...] = len(data)
        return out

    variants = [[b"first photo"], [b"second photo"]]
    ms = kerneltime.busy_ms(kernel, variants, [TensorSpec("uint8", (4,))], 3, budget_s=0.01)
    assert ms >= 0
    threads = {t for t, _, _ in calls}
    assert len(threads) == 3
    for t in threads:
        mine = [(d, o) for u, d, o in calls if u == t]
        assert len({d for d, _ in mine}) == kerneltime.RING  # inputs copied per item
        assert len({o for _, o in mine}) == kerneltime.RING  # a destination per item
    assert len({d for _, d, _ in calls}) == 3 * kerneltime.RING  # no buffer shared by workers
    assert not any(d in {id(v[0]) for v in variants} for _, d, _ in calls)


def test_profiling_leaves_ragged_outputs_to_the_kernel() -> None:
    from nicoffload import kerneltime
    from nicoffload.graph import Dim, TensorSpec

    outs = []

    def kernel(data, out=None):
        outs.append(out)
        return data

    spec = TensorSpec("uint8", (Dim("H", 375), Dim("W", 500), 3))
    kerneltime.busy_ms(kernel, [[b"x"]], [spec], 1, budget_s=0.001)
    assert outs and all(o is None for o in outs)


def _v1(kind: str, method: str) -> dict:
    return {
        "format": "nicoffload-profile",
        "version": 1,
        "kind": kind,
        "method": method,
        "kernels": {"decode_image": {"a_ms": 0.1, "b_ms": 5e-6, "unit": "pixels"}},
    }


@pytest.mark.parametrize("kind", ["cpu", "dpu"])
def test_a_decode_measured_before_decode_was_priced_as_it_runs_is_refused(
    tmp_path: Path, kind: str
) -> None:
    """Version 1 measured CPU/DPU profiles fit full-size decodes at the work of a 6/8 DCT-scaled
    one (the planner's old rule), 16/9 too little: planning with one is refused, saying how to
    measure it again."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_v1(kind, "measured: 8 worker threads")))
    with pytest.raises(ProfileError, match="6/8") as info:
        load_profile(path)
    assert f"measure it again with `nicoffload profile --device {kind}`" in str(info.value)
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    ("kind", "method"), [("cpu", "estimate: derived"), ("gpu", "measured: nvJPEG batched")]
)
def test_a_version_1_profile_whose_decode_price_still_holds_is_read(
    tmp_path: Path, kind: str, method: str
) -> None:
    """Estimates state their own basis, and a GPU decodes at full size as it always did."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_v1(kind, method)))
    assert load_profile(path).kernel("decode_image").ms(1000) == pytest.approx(0.105)


def test_a_profile_is_written_at_the_version_that_prices_decode_as_it_runs(tmp_path: Path) -> None:
    from nicoffload import profiles

    p = Profile("cpu", {"decode_image": KernelCost(0.1, 5e-6, "pixels")}, method="measured: x")
    p.save(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["version"] == profiles.VERSION == 4
    assert load_profile(tmp_path / "p.json").kernel("decode_image") is not None


def test_the_sweep_records_decode_work_as_the_pixels_the_kernel_decodes(
    tmp_path: Path, monkeypatch
) -> None:
    """The work a decode point is fitted at is the size of the image its kernel returns, built
    with the consumers the runtime builds it with."""
    from nicoffload import ops, profiling
    from nicoffload.planner.cost import chain_work

    if "cpu" not in ops.kernels_for("decode_image"):
        pytest.skip("the image kernels for cpu are not registered")
    monkeypatch.setattr(profiling, "IMAGE_SIZES", ((120, 160), (375, 500)))
    monkeypatch.setattr(profiling, "TOKEN_LENGTHS", ())
    cases = [c for c in profiling._pipelines(tmp_path, quick=False) if c[2] is None]
    assert len(cases) == 2  # the cases of every kernel (the decoder has more, at other qualities)
    for (pipeline, variants, _, _), (h, w) in zip(cases, profiling.IMAGE_SIZES, strict=True):
        decoded = profiling._upstream(pipeline, "cpu", variants[0])["decode"]
        assert chain_work(pipeline, ["decode"]) == decoded.shape[0] * decoded.shape[1]
        assert decoded.shape[:2] == (h, w)  # 0.7x leaves no DCT scale its 3x margin


def test_a_profile_measured_before_links_had_a_per_batch_cost_is_not_trusted_for_cpu(
    tmp_path: Path,
) -> None:
    """Such a profile measured raw sockets: the local topology keeps its bandwidth and latency
    but prices CPU by the transport's defaults (nicoffload's own transports, MAC'd)."""
    from nicoffload import topology

    doc = Profile("cpu", {}, {"tcp": LinkCost(0.03, 2.5e9, 0.19, 40.0)}).to_json()
    del doc["links"]["tcp"]["cpu_us_per_batch"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert load_profile(tmp_path / "old.json").links["tcp"].cpu_us_per_batch is None
    link = topology._measured_link("dpu0", "cpu", "tcp", str(tmp_path / "old.json"), 1.0)
    defaults = topology.TRANSPORTS["tcp"]
    assert (link.bandwidth, link.latency_ms) == (2.5e9, 0.03)
    assert link.cpu_ns_per_byte == defaults["cpu_ns_per_byte"]
    assert link.cpu_us_per_batch == defaults["cpu_us_per_batch"]
    (tmp_path / "new.json").write_text(
        json.dumps(Profile("cpu", {}, {"tcp": LinkCost(0.03, 2.5e9, 0.19, 40.0)}).to_json())
    )
    link = topology._measured_link("dpu0", "cpu", "tcp", str(tmp_path / "new.json"), 1.0)
    assert (link.cpu_ns_per_byte, link.cpu_us_per_batch) == (0.19, 40.0)


def test_links_are_measured_through_nicoffloads_own_transports() -> None:
    """A real exchange over the keyed tcp transport and over shm: bytes cost CPU on tcp (each
    end copies and MACs them), and each batch costs something on both."""
    from nicoffload import profiling_links

    wall, cpu = profiling_links.exchange("tcp", 1 << 16, 20)
    assert wall > 0 and cpu > 0
    per_batch_us, per_byte_ns = profiling_links.fit_per_batch(
        [(0, 50e-6), (1000, 51e-6), (2000, 52e-6)]
    )
    assert per_batch_us == pytest.approx(50.0) and per_byte_ns == pytest.approx(1.0)
    wall, cpu = profiling_links.exchange("shm", 1 << 16, 20)
    assert wall > 0 and cpu > 0


def test_profile_of_the_gpu_says_how_it_is_measured() -> None:
    """The per-item sweep cannot price batched GPU kernels: a clear pointer, not a traceback."""
    from typer.testing import CliRunner

    from nicoffload.cli import build_app

    result = CliRunner().invoke(build_app(), ["profile", "--device", "gpu"])
    assert result.exit_code != 0
    assert "bench_gpu.py" in result.output
    assert "Traceback" not in result.output


def test_a_link_measured_under_another_frame_mac_is_priced_by_the_defaults(tmp_path: Path) -> None:
    """HMAC-SHA256 frames cost about 3x GMAC's CPU per byte: a link measured under it keeps its
    bandwidth and latency, its CPU comes from the transport's defaults until measured again."""
    from nicoffload import topology

    doc = Profile("cpu", {}, {"tcp": LinkCost(0.03, 2.5e9, 1.0, 45.0)}).to_json()
    assert doc["links"]["tcp"]["frame_mac"] == "gmac"
    doc["links"]["tcp"].pop("frame_mac")  # as profiles measured before GMAC were written
    (tmp_path / "hmac.json").write_text(json.dumps(doc))
    assert load_profile(tmp_path / "hmac.json").links["tcp"].cpu_us_per_batch is None
    link = topology._measured_link("dpu0", "cpu", "tcp", str(tmp_path / "hmac.json"), 1.0)
    assert link.cpu_ns_per_byte == topology.TRANSPORTS["tcp"]["cpu_ns_per_byte"]
    assert (link.bandwidth, link.latency_ms) == (2.5e9, 0.03)
