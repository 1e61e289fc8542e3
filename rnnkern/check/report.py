"""The self-check's report: the table and failure lines, the advice for a
failing backend, the verdict, and the JSON's values."""
from __future__ import annotations

import datetime
import math
from pathlib import Path

import torch

from .. import ops
from .matrix import OPS, SIZES
from .problems import _ratio

#: Backends to recommend instead of a failing one, best first, per device type.
#: The Triton interpreter is never one: it is a CPU test vehicle, not a way to run models.
PREFERENCE = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}

WHERE_TO_REPORT = "open an issue on the project's tracker with the JSON report attached"


def _row_groups(records: list[dict]) -> list[tuple[tuple, list[dict]]]:
    groups: dict = {}
    for r in records:
        groups.setdefault((r["op"], r["size"], r["dtype"]), []).append(r)
    return list(groups.items())


def _case_name(r: dict) -> str:
    return r["cell"] + ("+proj" if r["proj"] else "") + (f" {r['variant']}" if r["variant"] else "")


def _table_lines(backend: str, records: list[dict]) -> list[str]:
    lines = []
    for (op, size, dtype), rs in _row_groups(records):
        failed = [r for r in rs if not r["ok"]]
        ratios = [(_ratio(r["worst"]), r) for r in rs if r.get("worst")]
        ratio, r = max(ratios, key=lambda t: t[0]) if ratios else (math.inf, rs[0])
        worst = f"{ratio:8.3g}x  {_case_name(r)}: {r['worst']['tensor']}" if ratios else ""
        crashed = [r for r in rs if "exception" in r]
        if crashed:
            worst = f"{_case_name(crashed[0])}: {crashed[0]['exception'][:60]}"
        result = "pass" if not failed else f"FAIL {len(failed)}"
        lines.append(f"{backend:<10} {OPS[op] + ('' if size != 'large' else ', large'):<50} {dtype:<9} "
                     f"{len(rs):>5}  {result:<7} {worst}")
    return lines


def _failure_lines(backend: str, records: list[dict]) -> list[str]:
    lines = []
    for r in records:
        if r["ok"]:
            continue
        head = f"  FAIL {backend}: {OPS[r['op']]}, {_case_name(r)}, {r['dtype']}, {r['size']} ({SIZES[r['size']].label()})"
        if "exception" in r:
            lines.append(f"{head}: {r['exception'][:300]}")
            continue
        for t in r["tensors"]:
            if not t["error"] <= t["allowed"]:
                what = t.get("problem") or f"error {t['error']:.3e} > allowed {t['allowed']:.3e}"
                lines.append(f"{head}: {t['tensor']} {what}")
    return lines


def advice(report: dict) -> dict:
    """For each failing backend, the backend to use instead (a sentence)."""
    passed = {(b["backend"], b["device"]) for b in report["backends"].values() if b.get("ok")}
    out = {}
    for name, b in report["backends"].items():
        if b.get("ok") is not False:
            continue
        device = b["device"]
        others = [x for x in PREFERENCE[device] if x != name and (x, device) in passed]
        if others:
            alt = others[0]
            out[name] = (f"use backend='{alt}' instead (rnnkern.LSTM(..., backend='{alt}'), "
                         f"rnnkern.convert(model, backend='{alt}'))")
        elif device == "cuda" and ("cpu", "cpu") in passed:
            out[name] = "no backend passed on the GPU: run the model on the CPU with backend='cpu', or use torch.nn"
        else:
            out[name] = f"no rnnkern backend passed on the {device}: use torch.nn's modules until this is fixed"
        auto = ops.resolve_backend("auto", torch.device(device))
        if auto == name:
            out[name] += f" (backend='auto', the default, picks '{name}' on this {device})"
    return out


def _verdict_lines(report: dict) -> list[str]:
    n = len(report["cases"])
    if report["ok"]:
        verb = "agrees" if len(report["backends"]) == 1 else "agree"
        return [f"OK: {', '.join(report['backends'])} {verb} with the float64 reference and torch.nn "
                f"({n} cases, {report['seconds']:.1f} s)."]
    bad = [b for b, v in report["backends"].items() if not v["ok"]]
    failed = sum(v["failed"] for v in report["backends"].values())
    return ([f"MISMATCH in {', '.join(repr(b) for b in bad)} ({failed} of {n} cases failed, "
             f"{report['seconds']:.1f} s)."]
            + [f"  {name}: {sentence}" for name, sentence in report["advice"].items()]
            + [f"Please {WHERE_TO_REPORT}."])


def _jsonable(value):
    """``value`` with non-finite floats (an error that is NaN or inf) as None:
    strict JSON has no Infinity."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def default_json_path() -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path.cwd() / f"rnnkern-check-{stamp}.json"
