"""The handwritten digits scikit-learn ships, as the bundled tiny model's data, and a judge for it.

The 1,797 8x8 digits (UCI optical digits) are upsampled to 16x16 and scaled to [-1, 1]. A fixed, seeded
split keeps a quarter of them away from the generator: the classifier that judges generated samples is
trained only on that held-out quarter, so it has never seen an image the generator learned from.
"""

from __future__ import annotations

import numpy as np

IMAGE_SIZE = 16
SPLIT_SEED = 1234
HELD_OUT_FRACTION = 0.25


def _upsample(images8: np.ndarray) -> np.ndarray:
    """[N, 8, 8] in 0..16 -> [N, 16, 16] in [-1, 1], bilinear (half-pixel centres)."""
    x = images8.astype(np.float32) / 16.0
    src = (np.arange(IMAGE_SIZE) + 0.5) * 8 / IMAGE_SIZE - 0.5
    lo = np.clip(np.floor(src).astype(int), 0, 7)
    hi = np.clip(lo + 1, 0, 7)
    w = np.clip(src - lo, 0.0, 1.0).astype(np.float32)
    rows = x[:, lo, :] * (1 - w)[None, :, None] + x[:, hi, :] * w[None, :, None]
    out = rows[:, :, lo] * (1 - w)[None, None, :] + rows[:, :, hi] * w[None, None, :]
    return out * 2.0 - 1.0


def load_split() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((train_images, train_labels), (held_out_images, held_out_labels)); images [N, 16, 16] in [-1, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = _upsample(digits.images)
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    n_held = int(round(len(labels) * HELD_OUT_FRACTION))
    held, train = order[:n_held], order[n_held:]
    return (images[train], labels[train]), (images[held], labels[held])


class DigitJudge:
    """Logistic regression on the held-out real digits; labels generated 16x16 images."""

    def __init__(self) -> None:
        from sklearn.linear_model import LogisticRegression

        _, (images, labels) = load_split()
        self.model = LogisticRegression(max_iter=2000, C=0.5)
        self.model.fit(images.reshape(len(images), -1), labels)

    def predict(self, images: np.ndarray) -> np.ndarray:
        images = np.clip(np.asarray(images, np.float32), -1.0, 1.0)
        return self.model.predict(images.reshape(len(images), -1))

    def accuracy(self, images: np.ndarray, labels: np.ndarray) -> float:
        return float(np.mean(self.predict(images) == np.asarray(labels)))
