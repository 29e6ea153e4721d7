"""Where an rdma receiver's ring lives when its consumer is a GPU: registered GPU memory itself
(GPUDirect RDMA, through a dma-buf or nvidia-peermem) when the platform offers it, otherwise
pinned host memory copied to the GPU asynchronously. `probe` looks, `choose` decides (pure).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DMABUF, PEERMEM, PINNED = "gpudirect-dmabuf", "gpudirect-peermem", "pinned-host"
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124  # cuda.h (CUDA >= 11.7)


@dataclass(frozen=True)
class GpuCaps:
    """What the platform offers a GPU destination, as `probe` found it."""

    gpu: bool  # a CUDA device answers
    rdma_device: str | None  # the verbs device the ring would be registered with
    verbs_dmabuf: bool  # rdma-core / pyverbs register a dma-buf (ibv_reg_dmabuf_mr)
    cuda_dmabuf: bool  # the CUDA driver exports device memory as a dma-buf
    peermem: bool  # nvidia_peermem (or the older nv_peer_mem) is loaded


@dataclass(frozen=True)
class Destination:
    kind: Literal["gpudirect-dmabuf", "gpudirect-peermem", "pinned-host"]
    reason: str

    @property
    def gpudirect(self) -> bool:
        return self.kind != PINNED

    def describe(self) -> str:
        """One line for `plan` and `run`: the choice and why."""
        return f"rdma GPU destination: {self.kind} ({self.reason})"


# What the rdma receiver lands into: its ring in GPU memory registered with the NIC under
# nvidia-peermem (ibv_reg_mr on a device pointer: `RdmaReceiver` with `?gpu=N`), else pinned
# host memory copied to the GPU (`GpuLanding`). Registering a CUDA dma-buf is not built: pyverbs
# registers a dma-buf from a file descriptor only through mlx5's own class (rdma-core 51 and
# later); Debian's rdma-core 44 takes DRM-allocated buffers alone.
SUPPORTED = frozenset({PEERMEM, PINNED})


def supported() -> frozenset[str]:
    """The destinations this version can land into (the same everywhere, for now)."""
    return SUPPORTED


def choose(caps: GpuCaps, supported: frozenset[str] = SUPPORTED) -> Destination:
    """GPUDirect through dma-buf first (upstream kernels, no out-of-tree module), then through
    nvidia-peermem, otherwise pinned host memory and an asynchronous copy to the GPU; a way this
    version cannot land into (`supported`) is passed over, saying so."""
    if not caps.gpu:
        return Destination(PINNED, "no CUDA device: the ring stays in host memory")
    if caps.rdma_device is None:
        return Destination(PINNED, "no RDMA device to register GPU memory with")
    passed = []
    if caps.verbs_dmabuf and caps.cuda_dmabuf:
        if DMABUF in supported:
            return Destination(
                DMABUF, f"dma-buf from the CUDA driver, registered on {caps.rdma_device}"
            )
        passed.append(f"{DMABUF} is available, but this version does not register dma-bufs")
    if caps.peermem:
        if PEERMEM in supported:
            return Destination(
                PEERMEM, f"nvidia-peermem loaded, GPU memory registered on {caps.rdma_device}"
            )
        passed.append(f"{PEERMEM} is available, but this version does not use it")
    if not passed:
        missing = [
            name
            for name, ok in (
                ("ibv_reg_dmabuf_mr in rdma-core/pyverbs", caps.verbs_dmabuf),
                ("dma-buf export in the CUDA driver", caps.cuda_dmabuf),
            )
            if not ok
        ]
        passed.append(
            f"no GPUDirect: neither dma-buf ({', '.join(missing)} missing) nor nvidia-peermem"
        )
    return Destination(
        PINNED, "; ".join(passed) + ": pinned host ring, asynchronous copy to the GPU"
    )


def probe(rdma_device: str | None) -> GpuCaps:
    """Look at this machine (kernel modules, rdma-core, the CUDA driver); never raises."""
    modules = ""
    with contextlib.suppress(OSError):
        modules = Path("/proc/modules").read_text()
    loaded = {line.split(" ", 1)[0] for line in modules.splitlines()}
    gpu, cuda_dmabuf = _cuda()
    return GpuCaps(
        gpu=gpu,
        rdma_device=rdma_device,
        verbs_dmabuf=_verbs_dmabuf(),
        cuda_dmabuf=cuda_dmabuf,
        peermem=any(m in loaded for m in PEERMEM_MODULES),
    )


def _verbs_dmabuf() -> bool:
    try:
        from nicoffload.transport import verbs

        verbs.pyverbs()
        return hasattr(importlib.import_module("pyverbs.mr"), "DmaBufMR")
    except Exception:  # no pyverbs, or one built without dma-buf support
        return False


def _cuda() -> tuple[bool, bool]:
    """(a CUDA device answers, it exports dma-bufs), from the driver API directly."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, False
    dev, value, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGetCount(ctypes.byref(count)) or not count.value:
        return False, False
    if cuda.cuDeviceGet(ctypes.byref(dev), 0):
        return True, False
    attr = CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, dev):
        return True, False
    return True, bool(value.value)


def for_plan(plan: Any, caps: GpuCaps | None = None) -> list[dict[str, Any]]:
    """Where each transfer from a DPU stage straight into a GPU stage lands, as this machine's
    capabilities decide it (`probe`, once): what `plan` reports and `run` does. Over rdma the
    receiver asks for its ring in GPU memory (`rdma://...?gpu=N`) and `choose` decides; over shm
    and tcp the receiver's host ring is page-locked and copied (`GpuLanding`). A link the
    topology calls `rdma-gpudirect` that this machine cannot honour says so."""
    stages = {s.name: s for s in plan.stages}
    out = []
    for t in plan.transfers:
        src, dst = stages.get(t.src_stage), stages.get(t.dst_stage)
        if dst is None or dst.kind != "gpu" or src is None or src.kind != "dpu":
            continue
        if t.transport.startswith("rdma"):
            if caps is None:
                caps = probe(_first_rdma_device())
            dest = choose(caps)
        else:
            dest = Destination(PINNED, host_ring_reason(t.transport.split("+")[0]))
        row = {
            "transfer": f"{t.src_stage} -> {t.dst_stage}",
            "tensor": t.tensor,
            "link": t.transport,
            "destination": dest.kind,
            "reason": dest.reason,
        }
        if t.transport == "rdma-gpudirect" and not dest.gpudirect:
            row["warning"] = (
                "the topology says rdma-gpudirect, but this machine lands the tensor in pinned "
                "host memory and copies it (one more PCIe crossing than the plan assumed)"
            )
        out.append(row)
    return out


def host_ring_reason(transport: str) -> str:
    """Why a receiver that is not rdma lands in host memory first."""
    return f"a {transport} receiver's ring is host memory: page-locked, one asynchronous copy per batch"


def _first_rdma_device() -> str | None:
    try:
        from nicoffload.transport import verbs

        found = verbs.devices()
    except Exception:  # no rdma-core / pyverbs here
        return None
    return found[0] if found else None


class GpuRing:
    """An rdma ring in GPU memory: one plain cudaMalloc allocation (not the pool's), so that the
    NIC pins exactly this range; `array` is a CuPy uint8 view of it (the receiver's slots)."""

    def __init__(self, gpu: int, nbytes: int) -> None:
        import cupy

        self.gpu, self.nbytes = gpu, nbytes
        with cupy.cuda.Device(gpu):
            self._mem = cupy.cuda.Memory(max(nbytes, 1))
            self.array = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(self._mem, 0))
        self.ptr = int(self._mem.ptr)

    def close(self) -> None:
        """Free the memory (after its region is deregistered); idempotent."""
        self.array = None
        self._mem = None


def register(endpoint: Any, ring: GpuRing, kind: str) -> Any:
    """The NIC's memory region over a GPU ring, the way `kind` allows."""
    if kind != PEERMEM:
        raise ValueError(f"cannot register GPU memory as {kind!r} in this version")
    return endpoint.register_address(ring.ptr, ring.nbytes, remote=True)
