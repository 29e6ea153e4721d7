"""decode_image on the GPU: nvJPEG through torchvision, batched, with the CPU decoder as the
explicit, counted fallback for what nvJPEG cannot or should not take.

Split from `gpu_image` (the resampling kernels) to keep both modules readable; importing it never
imports torch or CuPy until the kernel is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.errors import ItemError
from nicoffload.ops import kernel
from nicoffload.ops.gpu_image import _fail

# --- decode_image ----------------------------------------------------------------------------

# What goes to nvJPEG: 3-component baseline and extended Huffman JPEGs. The rest goes to the
# CPU decoder: PNG, CMYK, arithmetic coding, 1-component (gray) JPEGs, for which nvJPEG's
# batched path returned blank images on the H200 (torchvision 0.26, CUDA 13), and progressive
# JPEGs, whose Huffman decoding nvJPEG does on one host thread inside the batch call (the whole
# batch waited on it: 0.7 ms/item of host time on the mixed sample corpus); libjpeg-turbo on a
# pool of host threads decodes them while nvJPEG runs the rest.
_SOF = {0xC0, 0xC1}
_PROGRESSIVE = 0xC2


def nvjpeg_takes(head: tuple[int, int, int, int] | None) -> bool:
    """Whether the batched GPU decode takes a JPEG of this header (`jpeg_header`): baseline
    (SOF0/1) with three components; the others go to host threads or the host's decoder (and
    the planner prices them there: `sizes.typical_of`'s `host_decoded`)."""
    return head is not None and head[3] in _SOF and head[2] == 3 and bool(head[0] and head[1])


def jpeg_header(data: bytes) -> tuple[int, int, int, int] | None:
    """(height, width, components, SOF marker) of a JPEG, or None when it is not one."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            i += 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if i + 10 > n:
                return None
            h = (data[i + 5] << 8) | data[i + 6]
            w = (data[i + 7] << 8) | data[i + 8]
            return h, w, data[i + 9], marker
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


@dataclass
class DecodeStats:
    """Where a decoder's items went: nvJPEG, the CPU fallback, or failure."""

    gpu: int = 0
    cpu_fallback: int = 0  # what nvJPEG cannot take (or failed on) and the CPU decoded
    cpu_progressive: int = 0  # progressive JPEGs, decoded on host threads by choice
    failed: int = 0


@dataclass
class DecodeJob:
    """One batch between the decoder's three phases (prepare, run, finish)."""

    n: int
    gpu_rows: list[int] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)
    cpu_rows: list[int] = field(default_factory=list)
    cpu_items: list[Any] = field(default_factory=list)
    decoded: list[Any] | None = None
    progressive: list[tuple[int, Any]] = field(default_factory=list)  # (row, Future)


class _Decoder:
    """nvJPEG batch decode through torchvision; the CPU decoder takes what nvJPEG rejects.

    Three phases, so a pipeline can keep nvJPEG busy: `prepare` (host, Python), `run` (the
    nvJPEG call only, GIL released), `finish` (views, fallbacks); `fn(items)` runs all three.
    """

    def __init__(self, node: Any) -> None:
        import warnings

        from nicoffload.devices.gpu import device, torchvision_io

        self.gpu = device()
        self.io = torchvision_io()
        gray = node.params["color"] == "gray"
        self.channels = 1 if gray else 3
        # Always RGB from nvJPEG; gray output is computed from it as libjpeg does (BT.601 in
        # 16-bit fixed point), one path for every image nvJPEG takes.
        self.mode = self.io.ImageReadMode.RGB
        self._luma = None
        self.max_pixels = node.params["max_pixels"]
        self.stats = DecodeStats()
        self._cpu = self._cpu_decoder(node)
        self._pool: Any = None  # host threads for progressive JPEGs, on first need
        with warnings.catch_warnings():  # torch warns once that bytes are read-only: we only read
            warnings.simplefilter("ignore")
            self.gpu.torch.frombuffer(b"\xff", dtype=self.gpu.torch.uint8)

    def _cpu_decoder(self, node: Any) -> Any:
        from nicoffload import ops

        try:  # the CPU kernel, at full size (no DCT scaling: same geometry as nvJPEG's output)
            k = ops.get_kernel("decode_image", "cpu")
        except KeyError:
            return self._pil
        return k.build([node], ())

    def _pil(self, data: bytes) -> np.ndarray:
        import io

        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as im:
                arr = np.asarray(im.convert("L" if self.channels == 1 else "RGB"))
        except Exception as exc:
            raise ItemError("corrupt", f"cannot decode the image: {exc}") from None
        return arr[..., None] if arr.ndim == 2 else arr

    def __call__(self, items: Sequence[Any], out: Any = None, failed: dict | None = None) -> list:
        job = self.prepare(items, failed)
        self.run(job)
        return self.finish(job, failed)

    def prepare(self, items: Sequence[Any], failed: dict | None = None) -> DecodeJob:
        """Host only: read headers (refusing bombs), route each item, wrap bytes for nvJPEG."""
        torch = self.gpu.torch
        job = DecodeJob(len(items))
        for i, data in enumerate(items):
            if data is None or (failed is not None and i in failed):
                continue
            head = jpeg_header(data)
            if head is not None and head[0] * head[1] > self.max_pixels:
                self.stats.failed += 1
                _fail(failed, i, ItemError("too_large", f"{head[1]}x{head[0]} exceeds max_pixels"))
            elif nvjpeg_takes(head):
                job.gpu_rows.append(i)
                job.tensors.append(torch.frombuffer(data, dtype=torch.uint8))
            elif head is not None and head[3] == _PROGRESSIVE and head[2] in (1, 3):
                job.progressive.append((i, self._threads().submit(self._decode_upload, data)))
            else:
                job.cpu_rows.append(i)
                job.cpu_items.append(data)
        return job

    def _decode_upload(self, data: bytes) -> Any:
        """On a pool thread: libjpeg-turbo into the thread's scratch buffer, then a copy to the
        device that has completed when this returns (so the buffer may be reused)."""
        return self.gpu.upload(np.require(self._cpu(data), requirements=["C", "W"]))

    def _threads(self) -> Any:
        if self._pool is None:
            import os
            from concurrent.futures import ThreadPoolExecutor

            n = max(1, min(8, len(os.sched_getaffinity(0)) // 2))
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="nicoffload-jpeg")
        return self._pool

    def _gray(self, img: Any) -> Any:
        """uint8 (H, W, 1) luma of a (3, H, W) RGB image: (19595 R + 38470 G + 7471 B) >> 16."""
        torch = self.gpu.torch
        if self._luma is None:
            self._luma = torch.tensor([19595, 38470, 7471], dtype=torch.int32, device=img.device)
        y = (img.to(torch.int32) * self._luma[:, None, None]).sum(0).add_(32768) >> 16
        return y.to(torch.uint8)[..., None]

    def run(self, job: DecodeJob) -> None:
        """nvJPEG on the batch (torchvision releases the GIL and returns once decoded)."""
        if not job.tensors:
            return
        try:
            job.decoded = self.io.decode_jpeg(job.tensors, mode=self.mode, device=self.gpu.device)
        except RuntimeError:  # one bad item fails the batch call: find it
            job.decoded = []
            for t in job.tensors:
                try:
                    one = self.io.decode_jpeg([t], mode=self.mode, device=self.gpu.device)
                    job.decoded.append(one[0])
                except RuntimeError:
                    job.decoded.append(None)

    def finish(self, job: DecodeJob, failed: dict | None = None) -> list:
        """HWC views of nvJPEG's planes; the CPU decoder for what nvJPEG could not read."""
        res: list[Any] = [None] * job.n
        cpu = list(zip(job.cpu_rows, job.cpu_items, strict=True))
        for i, t, img in zip(job.gpu_rows, job.tensors, job.decoded or (), strict=True):
            if img is None:
                cpu.append((i, t.numpy().tobytes()))
            else:
                res[i] = self._gray(img) if self.channels == 1 else img.permute(1, 2, 0)
        self.stats.gpu += sum(r is not None for r in res)
        for i, future in job.progressive:  # decoded on host threads meanwhile
            try:
                img = future.result()
            except ItemError as exc:
                self.stats.failed += 1
                _fail(failed, i, exc)
                continue
            self.stats.cpu_progressive += 1
            img.record_stream(self.gpu.current_stream())  # copied on the pool thread's stream
            res[i] = img
        for i, data in sorted(cpu, key=lambda p: p[0]):
            try:
                arr = self._cpu(data)
            except ItemError as exc:
                self.stats.failed += 1
                _fail(failed, i, exc)
                continue
            self.stats.cpu_fallback += 1
            res[i] = self.gpu.upload(np.require(arr, requirements=["C", "W"]))
        return res


@kernel("decode_image", "gpu", batched=True)
def _build_decode(nodes, consumers):
    """GPU (nvJPEG through torchvision, batched; hardware engine where the GPU has one).
    Host bytes in, uint8 HWC CUDA tensors out (RGB: views of CHW planes); the CPU decoder takes
    what nvJPEG rejects (counted in `fn.stats`). `fn` takes a whole batch."""
    return _Decoder(nodes[0])
