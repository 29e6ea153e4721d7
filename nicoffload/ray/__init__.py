"""Scale-out on Ray (the `ray` extra): a server's topology from the cluster's labelled nodes
(`topology`), DPU agents as Ray actors placed by label selectors (`agents`), and the connection
to the cluster (`cluster`). Ray carries descriptors and lifecycle; tensors stay on our
transports. Nothing here is imported by `import nicoffload`.
"""

from __future__ import annotations

from nicoffload.errors import UserError


def require_ray() -> None:
    """A clear error when the extra is missing."""
    from importlib.util import find_spec

    if find_spec("ray") is None:
        raise UserError("--ray needs Ray, which is not installed: pip install 'nicoffload[ray]'")
