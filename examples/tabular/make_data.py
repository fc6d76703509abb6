"""Write a CSV for examples/tabular: N rows (default 2,000) of 8 features around 3 class centres, seeded.

    python examples/tabular/make_data.py OUT.csv [ROWS]
"""

from __future__ import annotations

import argparse
import csv
import random
import sys


def positive(text: str) -> int:
    """argparse's type for a count of at least 1 (its error line: "invalid positive value: '0'")."""
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python examples/tabular/make_data.py",
                                 description="A seeded CSV of 8 features and 3 classes for examples/tabular.")
    ap.add_argument("out", metavar="OUT.csv")
    ap.add_argument("rows", metavar="ROWS", type=positive, nargs="?", default=2000, help="rows (default 2,000)")
    args = ap.parse_args(argv)
    try:
        write(args.out, args.rows)
    except OSError as e:
        print(f"make_data: cannot write {args.out}: {e.strerror or e}; choose a path you can write", file=sys.stderr)
        return 1
    print(f"{args.out}: {args.rows:,} rows")
    return 0


def write(path: str, rows: int) -> None:
    rng = random.Random(0)
    centres = [[rng.uniform(-2, 2) for _ in range(8)] for _ in range(3)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"f{i}" for i in range(8)] + ["label"])
        for _ in range(rows):
            label = rng.randrange(3)
            w.writerow([f"{c + rng.gauss(0, 1):.4f}" for c in centres[label]] + [label])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
