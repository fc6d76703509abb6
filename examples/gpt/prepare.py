"""Turn a text file into token files for examples/gpt: its UTF-8 bytes as uint16 token ids (vocabulary 256),
the last tenth held out.

    python examples/gpt/prepare.py INPUT.txt OUT_DIR     # writes OUT_DIR/train.bin and OUT_DIR/val.bin
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python examples/gpt/prepare.py",
                                 description="A text file's bytes as uint16 token files for examples/gpt.")
    ap.add_argument("text", metavar="INPUT.txt", type=Path)
    ap.add_argument("out", metavar="OUT_DIR", type=Path)
    args = ap.parse_args(argv)
    out = args.out
    try:
        data = np.frombuffer(args.text.read_bytes(), dtype=np.uint8).astype(np.uint16)
    except OSError as e:
        print(f"prepare: cannot read {args.text}: {e.strerror or e}; name an existing text file", file=sys.stderr)
        return 2
    if len(data) < 20:
        print(f"prepare: {args.text} has {len(data)} bytes; a text of a few kB at least makes a usable token file",
              file=sys.stderr)
        return 2
    cut = int(len(data) * 0.9)
    try:
        out.mkdir(parents=True, exist_ok=True)
        data[:cut].tofile(out / "train.bin")
        data[cut:].tofile(out / "val.bin")
    except OSError as e:
        print(f"prepare: cannot write {out}: {e.strerror or e}; choose a folder you can write", file=sys.stderr)
        return 1
    print(f"{out / 'train.bin'}: {cut:,} tokens; {out / 'val.bin'}: {len(data) - cut:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
