"""`python -m job.telemetry --bench-scrape [--bench-overhead]`: the scrape benchmark (job/telemetry/scrapebench.py)."""

import logging
import sys

from job.telemetry.scrapebench import _bench_main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(_bench_main(sys.argv[1:]))
