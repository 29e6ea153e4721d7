"""nicoffload: declare, plan and run the preprocessing of AI serving pipelines across DPU, CPU and GPU."""

from nicoffload.errors import (
    ItemError,
    NicoffloadError,
    PlanError,
    SpecError,
    SystemFailure,
    TransportError,
    UserError,
)
from nicoffload.graph import Node, Pipeline, TensorSpec, load_pipeline
from nicoffload.planner.plan import Plan
from nicoffload.runner import RunResult, RunStats
from nicoffload.session import Session, SessionClosed, open, run


def __getattr__(name: str):
    # Client pulls in the agent protocol; loaded on first use to keep `import nicoffload` light.
    if name == "Client":
        from nicoffload.client import Client

        return Client
    raise AttributeError(f"module 'nicoffload' has no attribute '{name}'")


__version__ = "0.1.0"

__all__ = [
    "Client",
    "ItemError",
    "NicoffloadError",
    "Node",
    "Pipeline",
    "Plan",
    "PlanError",
    "RunResult",
    "RunStats",
    "Session",
    "SessionClosed",
    "SpecError",
    "SystemFailure",
    "TensorSpec",
    "TransportError",
    "UserError",
    "__version__",
    "load_pipeline",
    "open",
    "run",
]
