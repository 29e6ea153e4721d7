"""What a LOAD sends an emulated DPU's agent: the pipeline's text, with each tokenizer file its
stage reads staged under an id in a folder the agent is started with as its `tokenizer_dir`.

An agent takes tokenizers by id only, never by path (a client must not make it open files by
name); the host's own pipelines may name tokenizer files by path. For the agent this host
starts itself (the emulated DPU), the host stages the files it names; a real agent's operator
puts them in its `tokenizer_dir`, and the pipeline names them by file name.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from nicoffload.graph import Pipeline
from nicoffload.planner.plan import StagePlan


def load_text(pipeline: Pipeline, stage: StagePlan, folder: Path | None) -> tuple[str, Path | None]:
    """The pipeline text to LOAD, and the tokenizer_dir to start the agent with (None: none
    needed). `folder` (an emulated agent's own temporary folder) receives the staged files;
    None (a real agent) sends the text as it is."""
    text = Path(pipeline.path).read_text(encoding="utf-8")
    files = {
        n: Path(pipeline.node(n).params["tokenizer"])
        for n in stage.nodes
        if pipeline.node(n).op == "tokenize"
    }
    if folder is None or not files:
        return text, None
    where = folder / "tokenizers"
    where.mkdir(exist_ok=True)
    ids: dict[str, str] = {}
    order = [n.name for n in pipeline.nodes]  # ids by the node's place: unique across stages
    for node, path in sorted(files.items()):
        stem = re.sub(r"[^A-Za-z0-9_.@-]", "-", path.stem)[:40] or "tokenizer"
        ids[node] = f"t{order.index(node)}-{stem}"
        shutil.copyfile(path, where / f"{ids[node]}.json")
    doc = yaml.safe_load(text)
    for entry in doc["nodes"]:
        if entry.get("name") in ids:
            entry.setdefault("params", {})["tokenizer"] = ids[entry["name"]]
    return yaml.safe_dump(doc, sort_keys=False), where
