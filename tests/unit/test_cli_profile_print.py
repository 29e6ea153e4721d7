"""What `nicoffload profile` prints of a measured profile: each kernel's fit, the decoder's
progressive ratio, the runtimes and the host process's serial time (the measurement itself is
test_profiles'; here it is replaced by a fixed profile)."""

from __future__ import annotations

from typer.testing import CliRunner

from nicoffload import profiling
from nicoffload.cli import build_app
from nicoffload.profiles import KernelCost, LinkCost, Profile


def test_the_printout_names_every_term(tmp_path, monkeypatch) -> None:
    prof = Profile(
        "cpu",
        {"decode_image": KernelCost(0.1, 3e-6, "pixels", ((1.0, 2.0, 3.0),), 1e-6, 2.91)},
        {"tcp": LinkCost(0.03, 2.5e9, 0.3, 60.0)},
        runtime_us_per_item=12.0,
        serial_us_per_item=150.0,
        serial_us_per_batch=640.0,
    )
    monkeypatch.setattr(profiling, "measure", lambda kind, quick=False, progress=None: prof)
    out = tmp_path / "cpu.json"
    result = CliRunner().invoke(build_app(), ["profile", "--output", str(out)])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "progressive JPEGs 2.91x" in text
    assert "host process serial (GIL)" in text and "150.0 us/item + 640.0 us/batch" in text
    assert out.exists()
