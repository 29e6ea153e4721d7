"""Every exception nicoffload raises, in one tree.

    NicoffloadError                 base of everything below
    ├── UserError                   the user's input is wrong; CLI exit code 2, no traceback
    │   ├── SpecError               a pipeline file (carries file:line:col)
    │   ├── TopologyError           a topology file
    │   ├── ProfileError            a profile file
    │   └── PlanError               no placement satisfies the constraints
    ├── SystemFailure               the system failed; CLI exit code 1, names the component
    │   ├── MissingDependency       an optional package is absent (names the extra to install)
    │   ├── DeviceError             a device (GPU, DPU agent, RDMA NIC) is absent or failed
    │   ├── TransportError          a transport failed (keeps the foreign exception as __cause__)
    │   │   └── FrameError          a malformed or unexpected frame on the wire
    │   ├── AgentError              the DPU agent refused or failed a request
    │   └── RunFailed               a run's items failed: every one, or any under `run --strict`
    └── ItemError                   one item failed (a corrupt JPEG); counted; fatal only under run --strict

Foreign exceptions are mapped at the boundary (`raise TransportError(...) from exc`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mark:
    """A position in a user's file; 1-based line and column, like editors show."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


class NicoffloadError(Exception):
    """Base of every nicoffload exception."""

    exit_code = 1


class UserError(NicoffloadError):
    """The user's input is wrong. The message says where and what would be right."""

    exit_code = 2

    def __init__(self, message: str, mark: Mark | None = None) -> None:
        self.message = message
        self.mark = mark
        super().__init__(f"{mark}: {message}" if mark else message)


class SpecError(UserError):
    """A mistake in a pipeline file."""


class TopologyError(UserError):
    """A mistake in a topology file."""


class ProfileError(UserError):
    """A profile file that is malformed or does not match the code."""


class PlanError(UserError):
    """No placement satisfies the pipeline's constraints (pins, kernels, memory, SLO)."""


class SystemFailure(NicoffloadError):
    """The system failed. The message names the component."""

    exit_code = 1


class MissingDependency(SystemFailure):
    """An optional dependency is not installed."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(
            f"{purpose} needs the Python package '{package}', which is not installed; "
            f"install it with: pip install 'nicoffload[{extra}]'"
        )


class DeviceError(SystemFailure):
    """A device is absent, unreachable or failed."""


class TransportError(SystemFailure):
    """A transport failed to move or signal a batch."""


class FrameError(TransportError):
    """A frame on the wire is malformed, oversize, inconsistent or of another version."""


class AgentError(SystemFailure):
    """The DPU agent refused or failed a request."""


class RunFailed(SystemFailure):
    """A run ended but its items failed: every one of them, or any one under `run --strict`.
    The message counts the failures by reason with an example of each."""


class ItemError(NicoffloadError):
    """One item of a run failed; `reason` is a short stable code used to count failures."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")
