"""`python -m job.bench`: the profiled child process that bench.mode=profile starts once per strategy."""

import sys

from job.bench.profiling import profile_main

if __name__ == "__main__":
    sys.exit(profile_main(sys.argv[1:]))
