"""GpuStage: a GPU placement run a batch at a time, pinned staging, outputs through DLPack."""

from __future__ import annotations

import gpu_reference as ref
import numpy as np

from nicoffload.devices.gpu import PinnedRing
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import StagePlan
from nicoffload.runtime.gpu_stage import GpuStage
from nicoffload.samples import sample_images

RESNET = "pipelines/resnet50.yaml"


def stage_for(pipeline, names: tuple[str, ...], **kw) -> GpuStage:
    keep = {str(r) for r in pipeline.outputs.values()}
    return GpuStage(pipeline, StagePlan("s0-gpu", "gpu0", "gpu", names), keep, **kw)


def test_streamed_batches_equal_one_batch_at_a_time(gpu):
    pipeline = load_pipeline(RESNET)
    items = [data for _, data in sample_images(24)]
    batches = [{"image": items[i : i + 8]} for i in range(0, 24, 8)]
    with stage_for(pipeline, ("decode", "resize", "crop", "norm")) as stage:
        streamed = [b.wait().outputs["norm"].cpu().numpy() for b in stage.stream(batches)]
        single = [stage.process(b).wait().outputs["norm"].cpu().numpy() for b in batches]
        assert [s.shape for s in streamed] == [(8, 3, 224, 224)] * 3
        for a, b in zip(streamed, single, strict=True):
            np.testing.assert_array_equal(a, b)
        assert set(stage.step_ms_per_item()) == {"decode", "resize+crop+norm"}


def test_each_stream_call_reuses_the_last_calls_streams(gpu):
    # the caching allocator keeps freed memory per stream: new streams every call strand it
    pipeline = load_pipeline(RESNET)
    jpegs = [data for _, data in sample_images(16)]
    imgs = list(np.random.default_rng(5).integers(0, 256, (16, 300, 400, 3), dtype=np.uint8))
    for names, batches in (  # three threads when decoding, else a pool of workers
        (("decode", "resize", "crop", "norm"), [{"image": jpegs[i : i + 8]} for i in (0, 8)]),
        (("resize", "crop", "norm"), [{"decode": imgs[i : i + 8]} for i in (0, 8)]),
    ):
        with stage_for(pipeline, names) as stage:
            for _ in stage.stream(batches):
                pass
            first = {id(s.decode) for s in stage._spare}
            for _ in stage.stream(batches):
                pass
            assert first and {id(s.decode) for s in stage._spare} == first


def test_host_images_are_staged_through_pinned_memory(gpu):
    pipeline = load_pipeline(RESNET)
    rng = np.random.default_rng(4)
    imgs = [rng.integers(0, 256, (375, 500, 3), dtype=np.uint8) for _ in range(5)]
    imgs.append(rng.integers(0, 256, (500, 333, 3), dtype=np.uint8))
    with stage_for(pipeline, ("resize", "crop", "norm")) as stage:
        hb = stage.host_batch([a.shape for a in imgs])
        for dst, src in zip(hb.arrays, imgs, strict=True):
            dst[...] = src
        out = stage.process({"decode": hb}).wait().outputs["norm"].float().cpu().numpy()
        uniform = stage.process({"decode": imgs[:5]}).wait().outputs["norm"]
    node = pipeline.node("norm")
    for i, img in enumerate(imgs):
        want = ref.normalize(
            ref.center_crop(ref.resize(img, pipeline.node("resize").params), (224, 224)),
            node.params,
        )
        ref.assert_close_to_dtype(out[i], want, "float16")
    np.testing.assert_array_equal(uniform.float().cpu().numpy(), out[:5])


def test_outputs_reach_cupy_without_a_copy(gpu):
    pipeline = load_pipeline(RESNET)
    items = [data for _, data in sample_images(4)]
    with stage_for(pipeline, ("decode", "resize", "crop", "norm")) as stage:
        batch = stage.process({"image": items})
        arrays = batch.as_cupy()
        assert arrays["norm"].data.ptr == batch.outputs["norm"].data_ptr()
        assert arrays["norm"].shape == (4, 3, 224, 224)


def test_a_pinned_slot_is_refilled_only_after_its_copy_read_it(gpu):
    torch = gpu.torch
    stream = gpu.new_stream()
    with PinnedRing(gpu, count=2, nbytes=1 << 20) as ring:
        outs = []
        for k in range(6):
            slot = ring.take(1 << 20)
            slot.array[:] = k
            outs.append((k, ring.copy_in(slot, 1 << 20, stream)))
        torch.cuda.synchronize()
        for k, t in outs:
            assert int(t.min()) == k == int(t.max())
