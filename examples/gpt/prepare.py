"""Turn a text file into token files for examples/gpt: its UTF-8 bytes as uint16 token ids (vocabulary 256),
the last tenth held out.

    python examples/gpt/prepare.py INPUT.txt OUT_DIR     # writes OUT_DIR/train.bin and OUT_DIR/val.bin
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python examples/gpt/prepare.py INPUT.txt OUT_DIR", file=sys.stderr)
        return 2
    data = np.frombuffer(Path(argv[0]).read_bytes(), dtype=np.uint8).astype(np.uint16)
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cut = int(len(data) * 0.9)
    data[:cut].tofile(out / "train.bin")
    data[cut:].tofile(out / "val.bin")
    print(f"{out / 'train.bin'}: {cut:,} tokens; {out / 'val.bin'}: {len(data) - cut:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
