"""Write a CSV for examples/tabular: N rows (default 2,000) of 8 features around 3 class centres, seeded.

    python examples/tabular/make_data.py OUT.csv [ROWS]
"""

from __future__ import annotations

import csv
import random
import sys


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: python examples/tabular/make_data.py OUT.csv [ROWS]", file=sys.stderr)
        return 2
    rows = int(argv[1]) if len(argv) > 1 else 2000
    rng = random.Random(0)
    centres = [[rng.uniform(-2, 2) for _ in range(8)] for _ in range(3)]
    with open(argv[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"f{i}" for i in range(8)] + ["label"])
        for _ in range(rows):
            label = rng.randrange(3)
            w.writerow([f"{c + rng.gauss(0, 1):.4f}" for c in centres[label]] + [label])
    print(f"{argv[0]}: {rows:,} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
