"""Re-read benchmark results files and list every figure over the physical bound its own run measured.

    python benchmarks/check_results.py benchmarks/results/*.json

A row is impossible when its GB/s is above the best bandwidth measured in the same run (or, in a file written
before runs recorded their best round, the peak op's median) by more than the margin of
:mod:`gaengine.tools.bench.plausible`, or when its run marked it invalid. Prints one line per such row, with the
likely cause; exit status 1 when there is any, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402, F401 - puts the repository root on sys.path

from gaengine.tools.bench.plausible import check_payload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="results JSON files (write_json's, run_gpu.sh's)")
    args = parser.parse_args(argv)
    bad = 0
    for path in args.files:
        if path.suffix != ".json":
            continue
        for row, reason in check_payload(json.loads(path.read_text())):
            print(f"{path}: INVALID MEASUREMENT: {row}: {reason}")
            bad += 1
    print(f"{bad} invalid figure(s) in {len(args.files)} file(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
