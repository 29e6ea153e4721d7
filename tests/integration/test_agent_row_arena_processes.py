"""With worker processes the agent keeps no row buffers (`dpu_agents/rowarena.py`): the workers'
own output arenas draw on the same ARENA budget, and row buffers grown at a session's second
batch left a worker no room for a row (every row then ran on the host). Found by review."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
from PIL import Image
from split_plans import agent_topology

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_placement

MIB = 1 << 20
PIPELINE = """name: d
inputs: {image: {kind: bytes, format: jpeg, typical: {height: 1000, width: 1000, bytes: 110000}}}
nodes:
  - {name: decode, op: decode_image, in: image, params: {color: rgb}}
outputs: {img: decode}
batch: {max_size: 5, max_wait_ms: 2}
"""


def jpeg(rng: np.random.Generator) -> bytes:
    px = rng.integers(0, 255, (63, 63, 3), np.uint8).repeat(16, 0).repeat(16, 1)[:1000, :1000]
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG")
    return buf.getvalue()


def test_rows_stay_on_the_agent_call_after_call_with_a_small_arena_budget(tmp_path: Path):
    token = tmp_path / "token"
    auth.write_token(token)
    config = tmp_path / "agent.toml"
    config.write_text(
        f"arena_bytes = {48 * MIB}\nmax_arena_bytes = {16 * MIB}\narena_keep_bytes = {MIB}\n"
    )
    (tmp_path / "d.yaml").write_text(PIPELINE)
    rng = np.random.default_rng(0)
    items = [jpeg(rng) for _ in range(30)]
    pipeline = load_pipeline(tmp_path / "d.yaml")
    with LocalAgent(token, cores=2, worker_processes="on", config=config) as agent:
        topology = agent_topology(agent)
        plan = plan_placement(pipeline, {"decode": "dpu0"}, topology)
        with nicoffload.open(pipeline, plan, topology, token_file=token, workers=2) as session:
            for call in range(3):
                got = session.run(items)
                assert got.ok.all()
                why = got.stats.failover
                ran = re.search(r"\((\d+) items? ran", str(why)) if why else None
                assert why is None, f"call {call}: {ran and ran.group(1)} rows on the host: {why}"
