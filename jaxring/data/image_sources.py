"""Host-side training data for DiT: labelled images and shuffled epochs of them (numpy only, no JAX).

Every batch is a pure function of (seed, step): resuming at step k gives exactly the batches an
uninterrupted run would have seen. On a multi-host run each host asks for its own rows of the global
batch (``process_index`` of ``process_count``) and reads only those rows from the corpus.

Image sources (``load_images``):
  * ``None``: scikit-learn's bundled 8×8 digits (1797 images, 1 channel, 10 classes).
  * a folder of png/jpg images, one class per subfolder (or a single class 0), as RGB.
  Every 10th image is the held-out "val" split when a split is asked for.

Tokens for GPT: `token_sources.py`; the checks both share: `source_checks.py`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxring.data.source_checks import check_hosts, check_regular, check_seed_step, check_split

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """images: float32 [N, image_size, image_size, channels] in [-1, 1]; labels: int32 [N]."""

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    name: str
    class_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return int(self.images.shape[0])


def _resize(img: Any, image_size: int) -> Any:
    from PIL import Image

    return img.resize((image_size, image_size), Image.Resampling.BILINEAR)


def _load_digits(image_size: int) -> ImageSource:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    raw = digits.images.astype(np.float32) / 16.0  # [1797, 8, 8] in [0, 1]
    out = np.stack([np.asarray(_resize(Image.fromarray(x), image_size)) for x in raw])
    images = np.clip(out * 2.0 - 1.0, -1.0, 1.0)[..., None].astype(np.float32)
    return ImageSource(images, digits.target.astype(np.int32), 10, "sklearn-digits", tuple(str(i) for i in range(10)))


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _load_rgb(path: Path, image_size: int) -> np.ndarray:
    """Centre-cropped to a square, resized (bilinear), RGB, in [-1, 1]."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
            w, h = img.size
            side = min(w, h)
            img = img.crop(((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side))
            arr = np.asarray(_resize(img, image_size), np.float32)
    except Exception as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"image {str(path)!r} cannot be read ({reason}); remove or replace it") from None
    return arr / 127.5 - 1.0


def _load_folder(folder: Path, image_size: int) -> ImageSource:
    accepted = "/".join(IMAGE_SUFFIXES)
    subdirs = sorted(p for p in folder.iterdir() if p.is_dir() and _image_files(p))
    if subdirs:
        loose = [p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
        if loose:
            raise ValueError(
                f"image folder {str(folder)!r} mixes class subfolders with loose images "
                f"({loose[0]!r}, ...): put every image in a class subfolder, or use no subfolders"
            )
        classes = [(c.name, _image_files(c)) for c in subdirs]
    else:
        classes = [("0", _image_files(folder))]
    if not classes[0][1]:
        raise FileNotFoundError(f"image folder {str(folder)!r} holds no {accepted} images")
    images, labels = [], []
    for label, (_, files) in enumerate(classes):
        images += [_load_rgb(f, image_size) for f in files]
        labels += [label] * len(files)
    return ImageSource(
        np.stack(images).astype(np.float32),
        np.array(labels, np.int32),
        len(classes),
        folder.name,
        tuple(c for c, _ in classes),
    )


IMAGE_VAL_EVERY = 10  # image i is held out ("val") when i % 10 == 9, in the source's fixed order


def _image_split(source: ImageSource, split: str) -> ImageSource:
    held_out = np.arange(len(source)) % IMAGE_VAL_EVERY == IMAGE_VAL_EVERY - 1
    keep = held_out if split == "val" else ~held_out
    if not keep.any():
        raise ValueError(
            f"image source {source.name} has {len(source)} images: too few for a {split!r} split "
            f"(every {IMAGE_VAL_EVERY}th image is held out)"
        )
    return dataclasses.replace(
        source, images=source.images[keep], labels=source.labels[keep], name=f"{source.name}[{split}]"
    )


def load_images(path: str | os.PathLike | None, *, image_size: int, split: str | None = None) -> ImageSource:
    """Labelled images [N, image_size, image_size, channels] in [-1, 1].

    path None: scikit-learn's digits (1 channel, 10 classes) resized with Pillow (bilinear). A folder:
    png/jpg images, RGB (3 channels), centre-cropped to a square and resized; the class is the subfolder
    name (sorted subfolder names get labels 0, 1, ...) or a single class 0 without subfolders. Everything
    is loaded into host memory. split: None (every image), "train" or "val" (every 10th image, in the
    source's fixed order, is held out).
    """
    if not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size {image_size!r} must be a positive integer")
    if split is not None:
        check_split(split)
    if path is None:
        source = _load_digits(image_size)
    else:
        folder = Path(path)
        if folder.exists():
            check_regular(folder, "image folder")
        if not folder.is_dir():
            raise FileNotFoundError(
                f"image folder {str(path)!r} does not exist or is not a directory; accepted: "
                f"None (scikit-learn's digits) or a folder of {'/'.join(IMAGE_SUFFIXES)} "
                f"images (one subfolder per class, or none)"
            )
        source = _load_folder(folder, image_size)
    return source if split is None else _image_split(source, split)


class ImageBatches:
    """(images, labels) batches, a pure function of (seed, step): epochs of shuffled images.

    Global sample i = step * batch_size + r is image ``perm_e[i % N]`` of epoch e = i // N, with
    ``perm_e = np.random.default_rng([seed, e]).permutation(N)``: every image once per epoch. Host
    ``process_index`` returns only its rows of the global batch.
    """

    def __init__(
        self, source: ImageSource, *, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
    ):
        self.local_batch_size = check_hosts(batch_size, process_index, process_count)
        check_seed_step(seed, 0)
        if len(source) < 1:
            raise ValueError(f"image source {source.name} is empty")
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.process_index, self.process_count = process_index, process_count

    def indices(self, step: int) -> np.ndarray:
        """[local_batch_size] int64: this host's image indices at `step`."""
        check_seed_step(self.seed, step)
        n = len(self.source)
        first = step * self.batch_size + self.process_index * self.local_batch_size
        i = np.arange(first, first + self.local_batch_size)
        epochs, pos = i // n, i % n
        perms = {e: np.random.default_rng([self.seed, int(e)]).permutation(n) for e in np.unique(epochs)}
        return np.array([perms[e][p] for e, p in zip(epochs, pos)], np.int64)

    def get(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(float32 [local, size, size, channels], int32 [local]) with local = batch_size / process_count."""
        idx = self.indices(step)
        return self.source.images[idx], self.source.labels[idx]
