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
        {"tcp": LinkCost(0.03, 2.5e9, 0.25)},
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
