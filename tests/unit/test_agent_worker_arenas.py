"""A worker process's arenas (`arenas.Arenas`): their bytes are taken from the agent's memory
budget (`arena`) and given back, none grows past max_arena_bytes or past what arena_bytes has
left, one over arena_keep_bytes goes after its chunk, and rows whose inputs do not fit are run
in smaller pieces, a row that cannot fit alone failing for the host to run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dpu_agents.arenas import FLOOR, IN, OUT, Arenas
from dpu_agents.budget import ARENA, Budget
from dpu_agents.config import AgentConfig, load_config
from dpu_agents.procs import _fitting
from nicoffload.errors import UserError
from nicoffload.runtime.batch import ON_HOST, SLOT_OVERFLOW

MIB = 1 << 20


def arenas(budget: Budget) -> Arenas:
    a = Arenas()
    a.use(budget)
    return a


def budget(total: int = 16 * MIB, most: int = 8 * MIB, keep: int = 1 * MIB) -> Budget:
    cfg = AgentConfig(arena_bytes=total, max_arena_bytes=most, arena_keep_bytes=keep)
    return Budget(cfg)


def on_disk(a: Arenas) -> int:
    """The bytes of the arenas' segments in /dev/shm."""
    return sum(Path(f"/dev/shm/{seg.name}").stat().st_size for seg in a.segs if seg is not None)


def test_an_arenas_bytes_are_taken_from_the_budget_and_given_back() -> None:
    b = budget()
    a = arenas(b)
    assert a.fit(IN, 100) and a.fit(OUT, 3 * MIB)
    assert a.size(IN) == FLOOR and a.size(OUT) == 3 * MIB
    assert b.snapshot()[ARENA] == FLOOR + 3 * MIB == on_disk(a)
    assert a.fit(IN, 300_000)  # grown: the old one's bytes are part of the new one's
    assert b.snapshot()[ARENA] == a.size(IN) + a.size(OUT) == on_disk(a)
    names = [seg.name for seg in a.segs if seg is not None]
    a.close()
    assert b.snapshot()[ARENA] == 0
    assert not any(Path(f"/dev/shm/{n}").exists() for n in names)


def test_an_arena_over_arena_keep_bytes_goes_after_its_chunk() -> None:
    b = budget(keep=1 * MIB)
    a = arenas(b)
    assert a.fit(IN, 500_000) and a.fit(OUT, 5 * MIB + 1)
    assert a.size(OUT) == 6 * MIB  # outsized: whole MiB, not the next power of two
    a.trim()
    assert a.size(OUT) == 0 and a.size(IN) == 512 << 10  # kept: it is within arena_keep_bytes
    assert b.snapshot()[ARENA] == 512 << 10
    a.close()


def test_no_arena_grows_past_max_arena_bytes() -> None:
    b = budget(most=8 * MIB)
    a = arenas(b)
    assert a.fit(OUT, 8 * MIB)
    assert not a.fit(OUT, 8 * MIB + 1)
    assert a.size(OUT) == 8 * MIB and b.snapshot()[ARENA] == 8 * MIB
    assert "more than the agent's max_arena_bytes (8388608)" in a.why(OUT, 8 * MIB + 1)
    a.close()


def test_the_arenas_of_every_worker_stay_within_arena_bytes() -> None:
    b = budget(total=10 * MIB, most=8 * MIB)
    first, second = arenas(b), arenas(b)
    assert first.fit(OUT, 6 * MIB)
    assert not second.fit(OUT, 6 * MIB)  # 12 MiB would be over the 10 of arena_bytes
    assert "arena_bytes (10485760) has no room now" in second.why(OUT, 6 * MIB)
    assert second.size(OUT) == 0 and b.snapshot()[ARENA] == 6 * MIB
    first.trim()  # its chunk is done: the outsized arena goes
    assert second.fit(OUT, 6 * MIB)
    first.close()
    second.close()
    assert b.snapshot()[ARENA] == 0


def rows_of(*sizes: int) -> list:
    return [(i, {"image": np.zeros(n, np.uint8)}) for i, n in enumerate(sizes)]


def test_rows_whose_inputs_do_not_fit_run_in_smaller_pieces() -> None:
    a = arenas(budget(most=2 * MIB, keep=1 * MIB))
    rows = rows_of(700_000, 700_000, 700_000, 700_000)
    failed: dict = {}
    run, refused, rest = _fitting(a, rows, failed)
    assert [r for r, _ in run] == [0, 1] and refused == [] and [r for r, _ in rest] == [2, 3]
    assert a.size(IN) <= 2 * MIB and not failed
    a.close()


def test_a_row_whose_inputs_do_not_fit_alone_fails_for_the_host_to_run() -> None:
    a = arenas(budget(most=2 * MIB, keep=1 * MIB))
    failed: dict = {}
    run, refused, rest = _fitting(a, rows_of(3 * MIB, 100), failed)
    assert run == [] and [r for r, _ in refused] == [0] and [r for r, _ in rest] == [1]
    reason, detail = failed[0]
    assert reason == SLOT_OVERFLOW and reason in ON_HOST
    assert "max_arena_bytes" in detail
    run, refused, rest = _fitting(a, rest, failed)
    assert [r for r, _ in run] == [1] and not refused and not rest
    a.close()


@pytest.mark.parametrize(
    "text",
    [
        "arena_keep_bytes = 300000000\n",  # over max_arena_bytes
        "max_arena_bytes = 2147483648\n",  # over arena_bytes
    ],
)
def test_arena_settings_out_of_order_are_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(UserError, match="arena_keep_bytes <= max_arena_bytes <= arena_bytes"):
        load_config(path)
