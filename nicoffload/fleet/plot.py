"""`simulate --plot`: each policy's goodput, host CPU saved and latency, side by side."""

from __future__ import annotations

from nicoffload.errors import MissingDependency
from nicoffload.fleet.run import FleetResult


def plot(result: FleetResult, path: str) -> None:
    """Three bar charts over the policies: goodput, host cores saved, p50 and p99 latency."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependency("matplotlib", "plot", "simulate --plot") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [p.policy for p in result.policies]
    x = np.arange(len(names))
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 4))
    a1.bar(x, [p.goodput_per_s for p in result.policies], color="tab:blue")
    a1.plot(x, [p.offered_per_s for p in result.policies], "k_", markersize=30, label="offered")
    a1.set_ylabel("goodput (items/s)")
    a1.legend()
    a2.bar(x, [p.host_cpu_saved_cores for p in result.policies], color="tab:green")
    a2.set_ylabel("host cores saved against all-host")
    for dx, key in ((-0.2, "p50_ms"), (0.2, "p99_ms")):
        a3.bar(x + dx, [getattr(p, key) or 0.0 for p in result.policies], 0.4, label=key[:-3])
    a3.set_ylabel("latency (ms)")
    a3.legend()
    for ax in (a1, a2, a3):
        ax.set_xticks(x, names, rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"fleet '{result.fleet}': {result.servers} servers, {result.duration_s:g} s simulated"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
