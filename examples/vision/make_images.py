"""Write a small image folder for examples/vision: one sub-folder per class (circle, square, stripes), N PNGs
each (default 40), 48x48 with seeded colours and positions.

    python examples/vision/make_images.py OUT_DIR [PER_CLASS]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: python examples/vision/make_images.py OUT_DIR [PER_CLASS]", file=sys.stderr)
        return 2
    out, per_class = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 40
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
    print(f"{out}: 3 classes x {per_class} images")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
