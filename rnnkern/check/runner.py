"""The self-check's run, start to end: :func:`check`."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

import torch

from ..tolerance import TOL
from .matrix import SIZES, plan, select_targets
from .probe import environment, environment_lines
from .problems import Checker, strict_numerics
from .report import _failure_lines, _jsonable, _table_lines, _verdict_lines, advice, default_json_path
from .timing import _speed_line, _timed

#: Identifies the layout of the JSON report (docs/check.md documents it).
SCHEMA = "rnnkern.check/1"


def check(backends: Optional[list] = None, quick: bool = False, speed_test: bool = True,
          json_path: Optional[os.PathLike] = None, file: Optional[TextIO] = None,
          command: Optional[str] = None) -> dict:
    """Runs the self-check, prints its report to ``file`` (default stdout), writes
    the JSON report to ``json_path`` (default: ./rnnkern-check-<date>-<time>.json)
    and returns it as a dict; ``report["ok"]`` is False on any mismatch.

    ``backends``: names to check (default: every backend this machine can run);
    one that cannot run here raises ValueError saying why.  ``quick``: float32 and
    bfloat16 only, lengths in reverse only, no large size.  ``speed_test``: time
    against torch.nn.  ``command``: how the check was started, for the report
    (default: this call)."""
    file = file or sys.stdout
    began = time.perf_counter()

    def say(line=""):
        print(line, file=file, flush=True)

    runnable, missing = select_targets(backends)
    json_path = Path(json_path) if json_path is not None else default_json_path()
    env = environment()
    report = {"schema": SCHEMA, "ok": None,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": command or (f"rnnkern.check(backends={backends!r}, quick={quick}, "
                                     f"speed_test={speed_test})"),
              "options": {"backends": [t.backend for t in runnable], "quick": quick, "speed": speed_test},
              "environment": env,
              "sizes": {k: dataclasses.asdict(v) for k, v in SIZES.items()},
              "tolerance": {"float64": TOL[torch.float64], "float32": TOL[torch.float32],
                            "half": "Frobenius error <= 2 x the reference's own error in that dtype + one rounding to it"},
              "backends": {}, "not_run": missing, "cases": [], "speed": {}, "advice": {}}
    say("rnnkern field self-check")
    for line in environment_lines(env):
        say("  " + line)
    say("backends: " + ", ".join(t.label() for t in runnable))
    for name, why in missing.items():
        say(f"not run: {name}: {why}")
    plans = {t.backend: plan(t, quick) for t in runnable}
    used = {c.size for cases in plans.values() for c in cases}
    say(f"sizes: {', '.join(f'{k} {v.label()}' for k, v in SIZES.items() if k in used)}")
    say()
    say(f"{'backend':<10} {'check':<50} {'dtype':<9} {'cases':>5}  {'result':<7} worst error / allowed")
    checker = Checker()
    for target in runnable:
        t0 = time.perf_counter()
        with strict_numerics():
            records = [{"backend": target.backend} | checker.run(target, case) for case in plans[target.backend]]
        report["cases"] += records
        report["backends"][target.backend] = {
            "backend": target.backend, "device": target.device.type, "interpreted": target.interpreted,
            "ok": all(r["ok"] for r in records), "cases": len(records),
            "failed": sum(not r["ok"] for r in records), "seconds": round(time.perf_counter() - t0, 2)}
        for line in _table_lines(target.backend, records):
            say(line)
    failures = [line for t in runnable for line in
                _failure_lines(t.backend, [r for r in report["cases"] if r["backend"] == t.backend])]
    if failures:
        say()
        say("failures:")
        for line in failures:
            say(line)
    if speed_test:
        say()
        for target in runnable:
            report["speed"][target.backend] = result = _timed(target, env)
            say(_speed_line(target.backend, result))
    report["ok"] = bool(runnable) and all(b["ok"] for b in report["backends"].values())
    report["advice"] = advice(report)
    report["seconds"] = round(time.perf_counter() - began, 2)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_jsonable(report), indent=1, allow_nan=False) + "\n")
    say()
    for line in _verdict_lines(report):
        say(line)
    say(f"JSON report: {json_path}")
    return report
