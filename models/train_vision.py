"""Demo vision model: a small DeiT (MultiMax or softmax twin) on scikit-learn's bundled digits.

The 8x8 digits are upscaled to 32x32 so the model sees ordinary image input; the server later
applies the same preprocessing (stored in the checkpoint) to uploaded images.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.deit import DeiT, DeiTConfig
from models.training import param_groups, warmup_cosine

IMAGE_SIZE = 32
DIGITS_PREPROCESS: dict[str, Any] = {
    "channels": "L",
    "image_size": IMAGE_SIZE,
    "resize": IMAGE_SIZE,
    "interpolation": "bilinear",
    "crop": "center",
    # Pixels are scaled to [0, 1] first; the digits are light ink on a dark background.
    "mean": [0.5],
    "std": [0.5],
}


def demo_config(multimax: tuple[str, ...]) -> DeiTConfig:
    return DeiTConfig(
        img_size=IMAGE_SIZE,
        patch_size=8,
        in_chans=1,
        num_classes=10,
        embed_dim=64,
        depth=4,
        num_heads=4,
        mlp_ratio=2.0,
        qkv_bias=False,
        pool="avg",
        multimax_attention="attention" in multimax,
        multimax_output="output" in multimax,
    )


def digits_split(seed: int = 0, heldout: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stratified train/held-out split of the digits as (N, 1, 32, 32) floats in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    idx = np.arange(len(labels))
    train_idx, test_idx = train_test_split(idx, test_size=heldout, random_state=seed, stratify=digits.target)
    return images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]


def normalize(images: torch.Tensor) -> torch.Tensor:
    return (images - 0.5) / 0.5


def augment(images: torch.Tensor, generator: torch.Generator, max_shift: int = 3) -> torch.Tensor:
    """Random translation by up to `max_shift` pixels (zero padding = background)."""
    n = images.shape[0]
    padded = F.pad(images, (max_shift,) * 4)
    dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator)
    dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator)
    rows = dy[:, None] + torch.arange(IMAGE_SIZE)[None, :]
    cols = dx[:, None] + torch.arange(IMAGE_SIZE)[None, :]
    batch = torch.arange(n)[:, None, None]
    return padded[:, 0][batch, rows[:, :, None], cols[:, None, :]].unsqueeze(1)


@torch.no_grad()
def accuracy(model: DeiT, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 256) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(labels), batch_size):
        logits = model(normalize(images[start : start + batch_size]))
        correct += int((logits.argmax(-1) == labels[start : start + batch_size]).sum())
    return correct / len(labels)


def train_vision(
    *,
    multimax: tuple[str, ...] = ("attention", "output"),
    epochs: int = 60,
    batch_size: int = 64,
    lr: float = 2e-3,
    weight_decay: float = 0.05,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train from scratch; returns config, weights, labels, preprocessing and held-out metrics."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    x_train, y_train, x_test, y_test = digits_split(seed)
    config = demo_config(multimax)
    model = DeiT(config)
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.999))
    steps_per_epoch = (len(y_train) + batch_size - 1) // batch_size
    total = epochs * steps_per_epoch
    scheduler = warmup_cosine(optimizer, warmup=5 * steps_per_epoch, total=total)
    start = time.perf_counter()
    bar = tqdm(total=total, desc=f"digits {'+'.join(multimax) or 'softmax'}", disable=not progress, unit="step")
    loss_value = float("nan")
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(y_train), generator=generator)
        for i in range(steps_per_epoch):
            idx = order[i * batch_size : (i + 1) * batch_size]
            logits = model(normalize(augment(x_train[idx], generator)))
            loss = F.cross_entropy(logits, y_train[idx], label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_value = loss.item()
            bar.set_postfix(loss=f"{loss_value:.3f}")
            bar.update()
    bar.close()
    seconds = time.perf_counter() - start
    return {
        "config": config.to_dict(),
        "state_dict": model.state_dict(),
        "labels": [str(d) for d in range(10)],
        "preprocess": DIGITS_PREPROCESS,
        "metrics": {
            "heldout_accuracy": accuracy(model, x_test, y_test),
            "train_accuracy": accuracy(model, x_train, y_train),
            "final_loss": loss_value,
            "heldout_examples": len(y_test),
            "epochs": epochs,
            "seconds": round(seconds, 1),
            "seed": seed,
        },
    }
