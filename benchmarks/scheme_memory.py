"""What one forward + backward of a scheme's attention layer costs the process: wall and CPU seconds, peak
resident memory and minor page faults, read with ``resource.getrusage`` around one call (peak memory is the
process's, so run one measurement per process).

Built as ``benchmarks/schemes.py`` builds it (default options, causal, batch 4, 8 heads of 64). ``--whole``
computes CoPE's bias for all queries at once instead of in chunks of rows (``positional/cope.py``), to compare.

    python benchmarks/scheme_memory.py cope --n 2048 [--whole]
"""
from __future__ import annotations

import argparse
import resource
import time

from poslab.positional import SCHEMES, cope
from schemes import step_fn  # benchmarks/schemes.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scheme", nargs="?", default="cope", choices=sorted(SCHEMES),
                        help="default cope, the scheme whose chunking this measures (run_all.sh passes none)")
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--whole", action="store_true", help="CoPE: the whole (n, n) at once, no chunks")
    args = parser.parse_args()
    if args.whole:
        cope.CHUNK_ELEMENTS = 1 << 62
    step = step_fn(args.scheme, args, args.n)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{args.scheme}{' (whole)' if args.whole else ''} at n {args.n}: wall {time.perf_counter() - start:.1f} s, "
          f"user {after.ru_utime - before.ru_utime:.1f} s, system {after.ru_stime - before.ru_stime:.1f} s, "
          f"peak RSS {after.ru_maxrss / 1e6:.2f} GB, minor page faults {after.ru_minflt - before.ru_minflt}")


if __name__ == "__main__":
    main()
