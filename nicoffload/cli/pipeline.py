"""`nicoffload validate` and `nicoffload schema`: check a pipeline file; publish its JSON Schema."""

from __future__ import annotations

from pathlib import Path

import typer

from nicoffload.cli import app, emit_json, handle_errors
from nicoffload.graph import load_pipeline
from nicoffload.schema import pipeline_schema


@app.command()
@handle_errors
def validate(
    pipeline: Path = typer.Argument(..., help="the pipeline YAML file"),
    json_out: bool = typer.Option(False, "--json", help="print the checked DAG as JSON"),
) -> None:
    """Check a pipeline file: YAML, ops, parameters, wiring, cycles, and dtype/shape on every edge."""
    p = load_pipeline(pipeline)
    if json_out:
        emit_json(
            {
                "name": p.name,
                "inputs": {k: str(v) for k, v in p.inputs.items()},
                "nodes": [
                    {
                        "name": n.name,
                        "op": n.op,
                        "in": [str(r) for r in n.inputs],
                        "params": n.params,
                        "out": {k: str(v) for k, v in n.out_specs.items()},
                    }
                    for n in p.nodes
                ],
                "outputs": {k: str(v) for k, v in p.output_specs().items()},
            }
        )
        return
    typer.echo(f"{pipeline}: ok, pipeline '{p.name}'", err=True)
    for n in p.nodes:
        ins = ", ".join(str(r) for r in n.inputs)
        outs = ", ".join(
            f"{k}={v}" if len(n.out_specs) > 1 else str(v) for k, v in n.out_specs.items()
        )
        typer.echo(f"  {n.name:<12} {n.op:<14} {ins:<16} -> {outs}")
    for name, spec in p.output_specs().items():
        typer.echo(f"  output {name}: {spec}")


@app.command()
@handle_errors
def schema() -> None:
    """Print the JSON Schema of pipeline files (point your editor's YAML plugin at it)."""
    emit_json(pipeline_schema())
