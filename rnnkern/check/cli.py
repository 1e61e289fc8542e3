"""``python -m rnnkern.check``: the command line of the field self-check."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from .matrix import select_targets
from .runner import check


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rnnkern.check",
        description="rnnkern's field self-check: every backend this machine runs against the float64 "
                    "reference and torch.nn, a quick speed comparison, and a JSON report to attach "
                    "to a bug report.  Exit status 1 on any mismatch.")
    parser.add_argument("--backends", type=lambda s: [b.strip() for b in s.split(",") if b.strip()],
                        help="comma-separated backends to check (default: every one that can run here: "
                             "reference, cpu, cuda, triton)")
    parser.add_argument("--quick", action="store_true",
                        help="float32 and bfloat16 only, variable lengths in reverse only, no large size")
    parser.add_argument("--json", metavar="PATH", help="where to write the JSON report "
                        "(default: ./rnnkern-check-DATE-TIME.json)")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed comparison with torch.nn")
    args = parser.parse_args(argv)
    try:
        select_targets(args.backends)
    except ValueError as e:
        parser.error(str(e))
    report = check(args.backends, quick=args.quick, speed_test=not args.no_speed, json_path=args.json,
                   command=" ".join(["python -m rnnkern.check", *(sys.argv[1:] if argv is None else argv)]))
    return 0 if report["ok"] else 1
