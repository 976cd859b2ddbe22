"""Shape-counting tasks drawn with PIL: 1-4 coloured shapes on a white canvas, one per quadrant.

    python -m agentrl_vlm.prepare_data --out data/shapes      # train.jsonl, test.jsonl and their PNGs

Rows are in verl's multimodal format: `images` (PNG paths, relative to the dataset file) beside a prompt
whose `<image>` marks where the picture goes; the ground truth is the count. Each row's
`extra_info.response` is a count drawn at random, independently of the picture: the warm start trains on it,
so it teaches the answer format (one digit) and nothing about counting, which GRPO has to learn from rewards.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

CANVAS = 112
"""Pixels per side: 8x8 patches of 14, i.e. 16 image tokens after the 2x2 merge (4 per quadrant)."""
COLOURS = ["red", "blue", "green", "orange", "purple", "black"]
QUESTION = "<image>How many shapes are in the picture? Answer with one digit."


def draw_shapes(count: int, rng: random.Random) -> Image.Image:
    """`count` (1-4) filled squares or circles of random colours, each in its own random quadrant."""
    image = Image.new("RGB", (CANVAS, CANVAS), "white")
    draw = ImageDraw.Draw(image)
    half = CANVAS // 2
    for quadrant in rng.sample(range(4), count):
        x0, y0 = (quadrant % 2) * half, (quadrant // 2) * half
        size = rng.randint(30, 46)
        left, top = x0 + rng.randint(2, half - size - 2), y0 + rng.randint(2, half - size - 2)
        box = (left, top, left + size, top + size)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape(box, fill=rng.choice(COLOURS))
    return image


def build_rows(count: int, seed: int, image_dir: Path, split: str) -> list[dict]:
    """`count` rows; their PNGs go to `image_dir` and rows name them relative to its parent."""
    rng = random.Random(seed)
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(count):
        shapes = rng.randint(1, 4)
        name = f"{split}_{k:04d}.png"
        draw_shapes(shapes, rng).save(image_dir / name)
        rows.append(
            {
                "prompt": [{"role": "user", "content": QUESTION}],
                "images": [f"{image_dir.name}/{name}"],
                "data_source": "shapes",
                "reward_model": {"style": "rule", "ground_truth": str(shapes)},
                "extra_info": {"index": k, "split": split, "response": str(rng.randint(1, 4))},
            }
        )
    return rows


def write_dataset(out: str | Path, n_train: int = 256, n_test: int = 200, seed: int = 0) -> dict[str, Path]:
    """Write `train.jsonl` and `test.jsonl` (+ `images/`) under `out`; returns their paths. Reuses a complete set."""
    out = Path(out)
    paths = {"train": out / "train.jsonl", "test": out / "test.jsonl"}
    stamp = out / f".complete-{n_train}-{n_test}-{seed}"
    if stamp.exists():
        return paths
    for split, count, split_seed in (("train", n_train, seed), ("test", n_test, seed + 1)):
        rows = build_rows(count, split_seed, out / "images", split)
        paths[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    stamp.touch()
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/shapes")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split, path in write_dataset(args.out, args.train, args.test, args.seed).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
