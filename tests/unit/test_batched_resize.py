"""The GPU decode path's batched resize (pipeline.data.gpu_decode.resized_crops): each row's crop, scale and flip as two
matrix products must give what resizing that crop alone gives (torch's antialiased bilinear, Pillow's filter)."""
import torch
import torch.nn.functional as F

from pipeline.data.gpu_decode import resample_weights, resized_crops


def _one(img, box, size):
    left, top, w, h, flip = box
    crop = img[None, :, top:top + h, left:left + w].to(torch.float32)
    res = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    return (res.flip(-1) if flip else res).round().clamp(0, 255).to(torch.uint8)


def test_a_batch_resized_at_once_equals_each_crop_resized_alone():
    g = torch.Generator().manual_seed(3)
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)
              for h, w in ((350, 400), (120, 90), (500, 333), (64, 64))]
    # shrinking (2x and more), growing (a small crop), a flipped box, the whole image, a box at the far corner
    boxes = [(10, 20, 300, 280, False), (5, 7, 40, 30, True), (0, 0, 333, 500, True), (32, 40, 32, 24, False)]
    out = resized_crops(images, boxes, 56)
    assert out.shape == (4, 3, 56, 56) and out.dtype == torch.uint8
    for k, (img, box) in enumerate(zip(images, boxes)):
        diff = (out[k].int() - _one(img, box, 56).int()).abs()
        assert int(diff.max()) <= 1, (k, int(diff.max()))


def test_each_output_reads_only_its_own_crop_and_its_weights_sum_to_one():
    w = resample_weights(torch.tensor([10.0, 0.0]), torch.tensor([30.0, 7.0]), 8, 50)
    assert torch.allclose(w.sum(-1), torch.ones(2, 8))
    assert float(w[0, :, :10].abs().sum()) == 0 and float(w[0, :, 40:].abs().sum()) == 0
    assert float(w[1, :, 7:].abs().sum()) == 0


def test_the_cpu_paths_resize_matches_the_gpu_paths_batched_one():
    """crops.resize_box (each CPU decode worker's resize) and resized_crops (the GPU path's) resize the same crop the
    same way: within a level, so decode=cpu and decode=gpu differ only by their JPEG decoders."""
    import numpy as np

    from pipeline.data.crops import resize_box

    g = torch.Generator().manual_seed(5)
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in ((350, 400), (90, 120))]
    boxes = [(10, 20, 300, 280, True), (5, 7, 40, 30, False)]
    gpu = resized_crops(images, boxes, 56)
    for k, (img, box) in enumerate(zip(images, boxes)):
        cpu = resize_box(np.ascontiguousarray(img.permute(1, 2, 0).numpy()), box, 56)
        diff = (torch.from_numpy(cpu).permute(2, 0, 1).int() - gpu[k].int()).abs()
        assert cpu.shape == (56, 56, 3) and int(diff.max()) <= 1, (k, int(diff.max()))
