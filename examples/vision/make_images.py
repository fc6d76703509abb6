"""Write a small image folder for examples/vision: one sub-folder per class (circle, square, stripes), N PNGs
each (default 40), 48x48 with seeded colours and positions.

    python examples/vision/make_images.py OUT_DIR [PER_CLASS]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw


def positive(text: str) -> int:
    """argparse's type for a count of at least 1 (its error line: "invalid positive value: '0'")."""
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python examples/vision/make_images.py",
                                 description="A small image folder for examples/vision: 3 classes of 48x48 PNGs.")
    ap.add_argument("out", metavar="OUT_DIR", type=Path)
    ap.add_argument("per_class", metavar="PER_CLASS", type=positive, nargs="?", default=40,
                    help="images a class (default 40)")
    args = ap.parse_args(argv)
    out, per_class = args.out, args.per_class
    try:
        write(out, per_class)
    except OSError as e:
        print(f"make_images: cannot write {out}: {e.strerror or e}; choose a folder you can write", file=sys.stderr)
        return 1
    print(f"{out}: 3 classes x {per_class} images")
    return 0


def write(out: Path, per_class: int) -> None:
    rng = random.Random(0)
    for cls in ("circle", "square", "stripes"):
        (out / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = Image.new("RGB", (48, 48), tuple(rng.randrange(256) for _ in range(3)))
            d = ImageDraw.Draw(img)
            x, y, r = rng.randrange(8, 40), rng.randrange(8, 40), rng.randrange(6, 14)
            ink = tuple(rng.randrange(256) for _ in range(3))
            if cls == "circle":
                d.ellipse((x - r, y - r, x + r, y + r), fill=ink)
            elif cls == "square":
                d.rectangle((x - r, y - r, x + r, y + r), fill=ink)
            else:
                for k in range(0, 48, 8):
                    d.rectangle((k, 0, k + 3, 47), fill=ink)
            img.save(out / cls / f"{i:03d}.png")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
