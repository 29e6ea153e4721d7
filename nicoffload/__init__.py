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

# loaded on first use: the runtime (Session, run: the executor, the transports' users) and the
# agent client are not what the agent daemon and its worker processes import this package for
# (0.1 s of every agent's start)
_LAZY = {
    "Client": "nicoffload.client",
    "RunResult": "nicoffload.runner",
    "RunStats": "nicoffload.runner",
    "Session": "nicoffload.session",
    "SessionClosed": "nicoffload.session",
    "open": "nicoffload.session",
    "run": "nicoffload.session",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nicoffload' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
