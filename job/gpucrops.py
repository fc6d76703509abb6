"""A batch's crops, resized and flipped on the GPU in one kernel launch (Triton): data.decode=gpu's last step.

nvJPEG returns one tensor an image, each of its own size. Cropping and resizing them one by one
(`datasets.crops_resized`) costs two kernels and a dozen Python operations an image: about 1,300 a batch of
256, run under Python's lock beside the thread that launches the model's kernels, which a compiled model
needs (its step is ~28 ms of Python per ~36 ms of GPU work on an H200). This kernel reads every image where
nvJPEG wrote it, through a table of (offset, size, crop, flip, row) an image, and writes each crop into its
row of the batch: one table copy and one launch a batch.

Each output pixel is computed as torch's CUDA `_upsample_bilinear2d_aa` computes it (antialiased bilinear,
align_corners=False: the same support, weights and order of sums, in float32), then rounded half to even,
as `crops_resized` rounds: the pixels equal its pixels up to float rounding (a level of 255 at most; a test
checks it in Triton's interpreter on the CPU, and tests/gpu on a card).

Triton comes with torch's CUDA builds. Where it is missing, or its kernel cannot be built here (Triton compiles
a launcher with the machine's C compiler on first use, and a runtime-only image may have none), `crops_into`
says so once in the log and returns False, and the caller crops image by image."""

from __future__ import annotations

import contextlib
import functools
import logging

_failed: list[str] = []  # why the kernel could not run in this process, once it failed: not tried again


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    """The kernel, made at first use: a run that never crops on a GPU never imports Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def crops(src, table, out, size, BLOCK: tl.constexpr):
        oy = tl.program_id(0)  # the output row
        row = table + tl.program_id(1) * 9  # the image's row of crops_into's table
        offset, h_img, w_img = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        top, left, ch, cw = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
        flip, dest = tl.load(row + 7), tl.load(row + 8)

        # Rows: torch's _compute_weights_span and _compute_weights for output row oy (bilinear: support 1).
        scale_h = ch.to(tl.float32) / size
        support_h = tl.where(scale_h >= 1.0, scale_h, 1.0)
        inv_h = tl.where(scale_h >= 1.0, 1.0 / scale_h, 1.0)
        center_h = scale_h * (oy + 0.5)
        ymin = tl.maximum((center_h - support_h + 0.5).to(tl.int32), 0)
        ysize = tl.minimum((center_h + support_h + 0.5).to(tl.int32), ch.to(tl.int32)) - ymin
        total_h = 0.0
        for j in range(0, ysize):
            total_h += tl.maximum(1.0 - tl.abs(((j + (ymin - center_h)) + 0.5) * inv_h), 0.0)

        # Columns: the same for every output column at once; a flipped crop reads its columns right to left.
        ox = tl.arange(0, BLOCK)
        inside = ox < size
        xs = tl.where(flip != 0, size - 1 - ox, ox)
        scale_w = cw.to(tl.float32) / size
        support_w = tl.where(scale_w >= 1.0, scale_w, 1.0)
        inv_w = tl.where(scale_w >= 1.0, 1.0 / scale_w, 1.0)
        center_w = scale_w * (xs.to(tl.float32) + 0.5)
        xmin = tl.maximum((center_w - support_w + 0.5).to(tl.int32), 0)
        xsize = tl.where(inside, tl.minimum((center_w + support_w + 0.5).to(tl.int32), cw.to(tl.int32)) - xmin, 0)
        taps = tl.max(xsize, axis=0)
        total_w = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(0, taps):
            w = tl.maximum(1.0 - tl.abs(((j + (xmin - center_w)) + 0.5) * inv_w), 0.0)
            total_w += tl.where(j < xsize, w, 0.0)
        total_w = tl.where(total_w != 0.0, total_w, 1.0)

        plane = h_img * w_img
        first = src + offset + (top + ymin) * w_img + left + xmin  # each column's first tap, channel 0
        for c in range(0, 3):
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for i in range(0, ysize):
                wy = tl.maximum(1.0 - tl.abs(((i + (ymin - center_h)) + 0.5) * inv_h), 0.0) / total_h
                line = tl.zeros((BLOCK,), dtype=tl.float32)
                for j in range(0, taps):
                    wx = tl.maximum(1.0 - tl.abs(((j + (xmin - center_w)) + 0.5) * inv_w), 0.0) / total_w
                    use = j < xsize
                    px = tl.load(first + c * plane + i * w_img + j, mask=use, other=0).to(tl.float32)
                    line += tl.where(use, px * wx, 0.0)
                acc += line * wy
            r = tl.floor(acc + 0.5)  # half to even, as torch.round
            r = tl.where((r - acc == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)
            r = tl.minimum(tl.maximum(r, 0.0), 255.0)
            tl.store(out + ((dest * 3 + c) * size + oy) * size + ox, r.to(tl.uint8), mask=inside)

    return crops


def crops_into(out, rows: list[int], images: list, crops: list, size: int) -> bool:
    """Write crop_resize of each image (uint8 3 x H x W tensors on out's device) into out[rows[k]]
    (out: n x 3 x size x size uint8, contiguous), in one launch on the current stream. False, with nothing
    written, where the kernel cannot run here."""
    import torch

    if _failed or not available():
        return False
    images = [im if im.is_contiguous() else im.contiguous() for im in images]  # the table's strides are C, H, W
    base = min(images, key=lambda t: t.data_ptr())
    origin = base.data_ptr()  # an image a row: where it lies from base, its size, its crop, flip, its row of out
    table = torch.tensor([[im.data_ptr() - origin, im.shape[1], im.shape[2], top, left, h, w, int(flip), r]
                          for im, (top, left, h, w, flip), r in zip(images, crops, rows)], dtype=torch.int64)
    if out.device.type == "cuda":  # pinned, so the copy does not wait for the card
        table = table.pin_memory().to(out.device, non_blocking=True)
    block = 1 << max(size - 1, 1).bit_length()
    try:
        with torch.cuda.device(out.device) if out.device.type == "cuda" else contextlib.nullcontext():
            _kernel()[(size, len(images))](base, table, out, size, BLOCK=block)  # on out's card, whatever thread
    except Exception as e:  # noqa: BLE001 - building or launching it: any failure means the per-image path
        _failed.append(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        logging.getLogger("job").warning(
            "data.decode=gpu: the batch's crops cannot run as one Triton kernel here (%s); they run image by "
            "image, which costs the training process more CPU (install a C compiler, e.g. gcc, for Triton)",
            _failed[0])
        return False
    return True
