"""Online augmentation of aligned faces (albumentations), seeded per sample, and the tensor conversion.

Every call takes the sample's own seed, so what an image turns into depends only on that seed: not on
the rank, the loader worker or how many samples that worker saw before. The sampler hands out the
seeds (``facepipe.data.batch_order``), which makes augmentation reproducible and a resumed run exact.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
import torch

from facepipe.config import AugmentParams

if TYPE_CHECKING:
    import albumentations as A

_PCG_INCREMENT = 0xDA3E39CB94B95BDB  # any odd constant: the PCG64 stream the seeds index into


def build_pipeline(params: AugmentParams, *, image_size: int) -> A.Compose | None:
    """The albumentations pipeline for ``params`` (transforms with probability 0 are left out).

    Works on [S, S, 3] uint8 RGB and keeps that shape (``image_size`` = S). ``None`` when every
    probability is 0.
    """
    import albumentations as A  # 2 s to import: only commands that augment pay for it

    transforms: list[A.BasicTransform] = []
    if params.p_crop > 0:
        transforms.append(
            A.RandomResizedCrop(
                size=(image_size, image_size), scale=params.crop_scale, ratio=params.crop_ratio, p=params.p_crop
            )
        )
    if params.p_hflip > 0:
        transforms.append(A.HorizontalFlip(p=params.p_hflip))
    if params.p_color_jitter > 0:
        transforms.append(
            A.ColorJitter(
                brightness=params.brightness,
                contrast=params.contrast,
                saturation=params.saturation,
                hue=params.hue,
                p=params.p_color_jitter,
            )
        )
    if params.p_grayscale > 0:
        transforms.append(A.ToGray(num_output_channels=3, p=params.p_grayscale))
    if params.p_blur > 0:
        transforms.append(A.GaussianBlur(blur_limit=0, sigma_limit=params.blur_sigma, p=params.p_blur))
    if params.p_jpeg > 0:
        transforms.append(A.ImageCompression(quality_range=params.jpeg_quality, p=params.p_jpeg))
    return A.Compose(transforms) if transforms else None


class Augmenter:
    """Applies the configured pipeline to one image with a given seed."""

    def __init__(self, params: AugmentParams, *, image_size: int) -> None:
        self.params = params
        self.image_size = image_size
        self.pipeline = build_pipeline(params, image_size=image_size)
        # One pair of generators shared by every transform, re-seeded in place per image: building
        # fresh ones costs ~35 us an image, setting their state ~6 us.
        self._numpy = np.random.Generator(np.random.PCG64(0))
        self._python = random.Random(0)
        if self.pipeline is not None:
            self.pipeline.set_random_state(self._numpy, self._python)

    def __call__(self, image: np.ndarray, seed: int) -> np.ndarray:
        """[S, S, 3] uint8 RGB -> augmented [S, S, 3] uint8 RGB; equal seeds give equal outputs.

        ``seed`` is a uniformly random 63-bit integer (as the sampler draws them); it is used
        directly as the PCG64 state, which needs no further mixing for such seeds.
        """
        if self.pipeline is None:
            return image
        self._numpy.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": seed, "inc": _PCG_INCREMENT},
            "has_uint32": 0,
            "uinteger": 0,
        }
        self._python.seed(seed)
        return self.pipeline(image=image)["image"]


def to_uint8_tensor(image: np.ndarray) -> torch.Tensor:
    """[H, W, 3] uint8 RGB -> [3, H, W] uint8 (normalized later, on the device, by :func:`normalize`)."""
    return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))


def normalize(images: torch.Tensor, *, mean: float = 127.5, std: float = 127.5) -> torch.Tensor:
    """uint8 pixels -> float32 ``(pixel - mean) / std``; float input passes through.

    The default (arcface, [-1, 1]) gives the same values :func:`to_tensor` gives, computed as
    ``pixel / 127.5 - 1`` as always (other roundings than ``(pixel - 127.5) / 127.5``); other
    normalisations (facenet: std 128) subtract first, as facenet-pytorch's ``fixed_image_standardization``.
    """
    if images.dtype != torch.uint8:
        return images
    if (mean, std) == (127.5, 127.5):
        return images.to(torch.float32).div_(127.5).sub_(1.0)
    return images.to(torch.float32).sub_(mean).div_(std)


def to_tensor(image: np.ndarray) -> torch.Tensor:
    """[H, W, 3] uint8 RGB -> [3, H, W] float32 in [-1, 1] (pixel / 127.5 - 1)."""
    # NumPy, not torch: torch's intra-op thread pool costs milliseconds per small tensor when the
    # cores are busy (training in the same process), NumPy runs these two passes in ~20 us.
    chw = np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32)
    np.divide(chw, 127.5, out=chw)
    np.subtract(chw, 1.0, out=chw)
    return torch.from_numpy(chw)
