"""Load a node on one device puts on another resource: the JPEGs a GPU decoder does not take
(`ops.gpu_decode.nvjpeg_takes`: baseline files of three components only; progressive, gray,
CMYK and arithmetic-coded ones) are decoded on the host by the process that runs the Session,
so a GPU decode of such a corpus costs that host CPU too, and the GPU decodes only the rest."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from nicoffload.graph import Pipeline
from nicoffload.profiles import Profile
from nicoffload.topology import Topology


def decoder_shares(pipeline: Pipeline) -> tuple[dict[str, float], dict[str, float]]:
    """Per decoder (a node whose op has the `encoded` feature), from the typical hints of the
    input it reads (`sizes.typical_of`, or the pipeline file): the share of its items that are
    progressive JPEGs, and the share a GPU decoder leaves to the host (`host_decoded`, at least
    the progressive one); 0 for other nodes."""
    progressive, leaves = {}, {}
    for n in pipeline.nodes:
        hints = dict(n.in_specs[0].hints) if n.in_specs and n.opdef().encoded else {}
        p = float(hints.get("progressive", 0.0))
        progressive[n.name], leaves[n.name] = p, max(p, float(hints.get("host_decoded", 0.0)))
    return progressive, leaves


def gpu_progressive(
    pipeline: Pipeline,
    topology: Topology,
    profiles: Mapping[str, Profile],
    cost: np.ndarray,
    pixels: Mapping[str, float],
    encoded: Mapping[str, float],
    shares: tuple[Mapping[str, float], Mapping[str, float]],
    host,
) -> tuple[tuple[int, int, int, float], ...]:
    """(node, GPU device, host device, core-ms per item) for each decoder with items the GPU
    leaves to the host (`shares`: per node, the progressive share and the whole share the GPU
    does not take, `nvjpeg_takes`) on each GPU it may run on: the host's decode of those (its
    profile's entry at the full-size pixels, progressive files at its progressive ratio).
    `cost` is set in place so that the GPU prices only its own share, at its baseline figure.
    Nothing where no host CPU or no host profile of the decoder."""
    share, leaves = shares
    if host is None or host.id not in profiles:
        return ()
    entry = profiles[host.id].kernel("decode_image")
    h = topology.ids.index(host.id)
    out = []
    for v, node in enumerate(pipeline.nodes):
        p, q = share.get(node.name, 0.0), leaves.get(node.name, 0.0)
        if node.op != "decode_image" or q <= 0 or entry is None:
            continue
        px, nbytes = pixels[node.name], encoded[node.name]
        host_ms = p * max(0.0, entry.ms(px, nbytes, 1.0)) + max(0.0, q - p) * max(
            0.0, entry.ms(px, nbytes, 0.0)
        )
        for d, dev in enumerate(topology.devices):
            gpu = profiles[dev.id].kernel("decode_image") if dev.id in profiles else None
            if dev.kind == "gpu" and gpu is not None and np.isfinite(cost[v, d]):
                # the GPU decodes only the baseline share (a GPU profile's own progressive_x,
                # if any, prices nothing: those files never reach it)
                own = max(0.0, gpu.ms(pixels[node.name], encoded[node.name], 0.0))
                cost[v, d] = (1.0 - q) * own
                out.append((v, d, h, host_ms))
    return tuple(out)
