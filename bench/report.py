"""What a run shows: the terminal tables, the markdown summary, the JSON and the plots."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from rnnkern.check.probe import cpu_identity, cpu_isa, cpu_model, git_commit, load_average

from .candidates import BASELINE

PHASE_LABEL = {"forward": "fwd", "forward_backward": "fwd+bwd"}
STATUS_MARK = {"disagrees": "DISAGREES", "error": "error", "skipped": "-"}


def _num(v, fmt):
    return "-" if v is None else format(v, fmt)


def _call(r) -> str:
    return r.get("call", "sequence")  # JSON written before the step family has no "call"


def _case_label(r) -> str:
    if _call(r) == "cell":
        return f"{r['cell']} cell B{r['B']} H{r['H']} {r['dtype']}"
    return f"{r['cell']} B{r['B']} T{r['T']} H{r['H']} {r['dtype']}"


def _is_step(r) -> bool:
    """A one-step case (T=1 sequence call or cell call): its tables give µs per call."""
    return _call(r) == "cell" or r["T"] == 1


def _us(ms) -> str:
    """Microseconds to three significant figures, without an exponent."""
    us = ms * 1e3
    return f"{us:.0f}" if us >= 1000 else f"{us:.3g}"


def _device_line(doc) -> str:
    m, p = doc["meta"], doc.get("peaks") or {}
    dev = m["device"]
    n = dev["threads"]
    where = dev["name"] + (f", {n} thread{'s' if n != 1 else ''}" if dev["type"] == "cpu" else "")
    isa = dev.get("isa")
    if isa:
        where += (f" ({'/'.join(isa['cpu_flags']) or 'no AVX2'}; torch {isa['torch_capability']}"
                  + (f", rnnkern {isa['rnnkern_vector_bits']}-bit" if "rnnkern_vector_bits" in isa else "")
                  + ("; capped: " + ", ".join(f"{k}={v}" for k, v in isa["caps"].items())
                     if isa.get("caps") else "") + ")")
    line = f"{where}; torch {m['versions']['torch']}"
    if p.get("copy_gbps"):
        gemm = ", ".join(f"{k} {v:.3g}" for k, v in p["gemm_tflops"].items())
        line += f"; measured peaks: GEMM TFLOP/s {gemm}; copy {p['copy_gbps']:.3g} GB/s"
    fma = p.get("fma")
    if fma and fma["tflops"]:
        peak = ", ".join(f"{k} {v:.3g}" for k, v in fma["tflops"].items())
        line += (f"; FMA peak TFLOP/s {peak} ({fma['core']}, {fma['threads']} x {fma['fma_units']} x "
                 f"{fma['fp32_lanes_per_unit']} fp32 lanes x 2 at {fma['clock_mhz']:.0f} MHz: %peak is of this)")
    return line


def case_line(r) -> str:
    """One case and phase in one line, as soon as it is measured: torch.nn's time and
    every other candidate's speed ratio (or why it has none)."""
    parts = []
    for name, e in r["candidates"].items():
        if e["status"] != "timed":
            parts.append(f"{e['label']} {STATUS_MARK[e['status']]}")
        elif name == BASELINE:
            parts.append(f"{e['label']} {_us(e['median_ms'])} us" if _is_step(r) else
                         f"{e['label']} {e['median_ms']:.3g} ms")
        else:
            parts.append(f"{e['label']} {e['speedup_vs_torch']:.2f}x ("
                         + (f"{_us(e['median_ms'])} us)" if _is_step(r) else f"{e['median_ms']:.3g} ms)"))
    return f"{_case_label(r)} {PHASE_LABEL[r['phase']]}: " + "; ".join(parts)


def load_warning(doc) -> str:
    """A warning when the CPU was oversubscribed during the run ('' otherwise)."""
    dev = doc["meta"]["device"]
    loads = [dev.get("load_average_at_start"), dev.get("load_average_at_end")]
    worst = max((l[0] for l in loads if l), default=None)
    if dev["type"] != "cpu" or worst is None or worst <= dev["cores"]:
        return ""
    msg = (f"WARNING: load average {worst:.1f} on {dev['cores']} cores: other processes hold the "
           f"CPU, so times are inflated; the ratios (interleaved) are more trustworthy than the "
           f"times.")
    if dev["threads"] > 1:
        msg += (" With several threads every kernel also waits for its descheduled threads: "
                "rerun when the machine is quiet, or compare with --threads 1.")
    return msg


def table(doc) -> str:
    """Every case, phase and candidate with every figure."""
    gpu = doc["meta"]["device"]["type"] == "cuda"
    head = (f"{'case':34} {'phase':7} {'candidate':14} {'ms':>9} {'vs torch':>8} {'us/step':>8} "
            f"{'TFLOP/s':>8} {'%peak':>6} {'GB/s':>7} {'%peak':>6}" + (f" {'mem MB':>8} {'mem/torch':>9}" if gpu else ""))
    lines = [_device_line(doc)] + ([load_warning(doc)] if load_warning(doc) else [])
    for name, c in doc["meta"]["candidates"].items():
        if not c["available"]:
            lines.append(f"not run: {c['label']} ({c['note']})")
    lines += [head, "-" * len(head)]
    last = None
    for r in doc["results"]:
        case = _case_label(r)
        if last is not None and case != last:
            lines.append("")
        last = case
        for name, e in r["candidates"].items():
            pre = f"{case:34} {PHASE_LABEL[r['phase']]:7} {e['label']:14} "
            if e["status"] == "timed":
                lines.append(pre + f"{e['median_ms']:9.3f} {e['speedup_vs_torch']:7.2f}x {e['us_per_step']:8.2f} "
                             f"{e['tflops']:8.3f} {_num(e['pct_peak_flops'], '6.1f')} {e['gbps']:7.2f} "
                             f"{_num(e['pct_peak_bw'], '6.1f')}"
                             + (f" {_num(e.get('peak_mem_mb'), '8.1f')} {_num(e.get('mem_vs_torch'), '9.2f')}"
                                if gpu else ""))
            else:
                note = e.get("note") or ""
                if e["status"] == "disagrees":
                    a = e["agreement"]
                    note = (f"{a['worst']}: rel. error {_num(a['rel_err'], '.2e')} > allowed "
                            f"{a['allowed']:.2e} (torch.nn's own {_num(a['torch_rel_err'], '.2e')})")
                lines.append(pre + f"{STATUS_MARK[e['status']]:>9} {note[:110]}")
    return "\n".join(lines)


#: The summary's sections: sequence calls (ratios, torch.nn's time in ms) and one-step
#: calls (ratios and every candidate's time per call in µs).
SECTIONS = ("sequence", "step")


def _summary(doc, phase, section="sequence"):
    """Header and rows of the ratio table of one phase and section (torch.nn's time,
    then each candidate's speed ratio; one-step calls also give each time in µs)."""
    step = section == "step"
    results = [r for r in doc["results"] if _is_step(r) == step]
    names = []
    for r in results:
        for n in r["candidates"]:
            if n != BASELINE and n not in names:
                names.append(n)
    labels = {}
    for r in results:
        for n, e in r["candidates"].items():
            labels[n] = e["label"]
    if step:
        header = ["cell", "call", "dtype", "B", "H", "torch.nn us"] + [f"{labels[n]} (us)" for n in names]
    else:
        header = ["cell", "dtype", "B", "T", "H", "torch.nn ms"] + [labels[n] for n in names]
    rows = []
    for r in results:
        if r["phase"] != phase:
            continue
        base = r["candidates"][BASELINE]
        timed = base["status"] == "timed"
        if step:
            call = "cell" if _call(r) == "cell" else "T=1"
            row = [r["cell"], call, r["dtype"], str(r["B"]), str(r["H"]),
                   _us(base["median_ms"]) if timed else base["status"]]
        else:
            row = [r["cell"], r["dtype"], str(r["B"]), str(r["T"]), str(r["H"]),
                   f"{base['median_ms']:.3g}" if timed else base["status"]]
        for n in names:
            e = r["candidates"].get(n)
            if e is None:
                row.append("")
            elif e["status"] == "timed":
                row.append(f"{e['speedup_vs_torch']:.2f}x" + (f" ({_us(e['median_ms'])})" if step else ""))
            else:
                row.append(STATUS_MARK[e["status"]])
        rows.append(row)
    return header, rows


HALF_DTYPES = ("bfloat16", "float16")


def _half_summary(doc, phase):
    """Header and rows of each candidate's speed in a half type against its own
    float32 on the same case (its float32 time / its half time; > 1: the half
    type is faster), for the sequence cases measured in both (the bf16 family)."""
    timed = {}
    for r in doc["results"]:
        if r["phase"] == phase and not _is_step(r):
            for n, e in r["candidates"].items():
                if e["status"] == "timed":
                    timed[(r["cell"], r["B"], r["T"], r["H"], r["dtype"], n)] = (e["median_ms"], e["label"])
    names, rows = [], []
    for (cell, B, T, H, dtype, n) in timed:
        if dtype in HALF_DTYPES and (cell, B, T, H, "float32", n) in timed and n not in names:
            names.append(n)
    labels = {n: lab for (*_, n), (_, lab) in timed.items()}
    seen = []
    for (cell, B, T, H, dtype, _) in timed:
        if dtype in HALF_DTYPES and (cell, B, T, H, dtype) not in seen:
            seen.append((cell, B, T, H, dtype))
    for cell, B, T, H, dtype in seen:
        row = [cell, dtype, str(B), str(T), str(H)]
        for n in names:
            half, full = timed.get((cell, B, T, H, dtype, n)), timed.get((cell, B, T, H, "float32", n))
            row.append(f"{full[0] / half[0]:.2f}x" if half and full else "")
        if any(row[5:]):
            rows.append(row)
    return ["cell", "dtype", "B", "T", "H"] + [labels[n] for n in names], rows


def _half_title(phase) -> str:
    return f"{'forward' if phase == 'forward' else 'forward + backward'}: half type against float32"


def _title(phase, section) -> str:
    what = "forward" if phase == "forward" else "forward + backward"
    if section == "step":
        return f"{what}, one step (T=1 sequence call, cell call; time per call in us)"
    return what


def summary(doc) -> str:
    """Speed ratios against torch.nn (> 1: faster than torch.nn), one table per phase
    (and per section: sequences, one-step calls)."""
    out = []
    for section in SECTIONS:
        for phase in ("forward", "forward_backward"):
            header, rows = _summary(doc, phase, section)
            if not rows:
                continue
            widths = [max(len(x) for x in col) for col in zip(header, *rows)]
            step = (", one step: T=1 sequence call or cell call, us per call in ()" if section == "step"
                    else "")
            out.append(f"speed vs torch.nn, {PHASE_LABEL[phase]}{step} (torch.nn time / candidate time; "
                       f"'-' not run, DISAGREES: not timed)")
            out.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
            out += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
            out.append("")
    for phase in ("forward", "forward_backward"):
        header, rows = _half_summary(doc, phase)
        if not rows:
            continue
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        out.append(f"{_half_title(phase)} (each candidate's float32 time / its own half-type time)")
        out.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
        out += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
        out.append("")
    notes = _not_run_notes(doc)
    if notes and doc["results"]:
        out.append("not run: " + "; ".join(notes))
    return "\n".join(out).rstrip()


def packed_line(r) -> str:
    """One line of the packed study (bench/packed.py): a cell's packed batch of skewed
    lengths against torch.nn, its lengths= twin, and packed / dense of the same steps."""
    return (f"{r['cell']} B={r['B']} longest {r['T']} H={r['H']}: {r['steps']} steps of a {r['grid']} grid; "
            f"torch.nn {r['ms']['torch.nn packed']:.3g} ms, rnnkern {r['ms']['rnnkern packed']:.3g} ms: "
            f"{r['speedup_vs_torch']:.2f}x (lengths= {r['ms']['rnnkern lengths=']:.3g} ms: "
            f"{r['lengths_speedup_vs_torch']:.2f}x); packed / dense of the same steps "
            f"{r['packed_over_dense']:.2f} (float64 agreement {r['float64_max_difference']:.1e})")


PACKED_HEADER = ["cell", "B", "longest T", "H", "steps / grid", "torch.nn packed (ms)",
                 "rnnkern-cpu packed", "rnnkern-cpu lengths=", "rnnkern packed / dense"]


def packed_rows(doc) -> list:
    """The packed study's table rows (forward + backward, float32): speed ratios against
    torch.nn's packed path, and rnnkern's packed time over its dense batch of the same
    number of steps (1.00: packing costs nothing beyond the real steps)."""
    return [[r["cell"], str(r["B"]), str(r["T"]), str(r["H"]), f"{r['steps']} / {r['grid']}",
             f"{r['ms']['torch.nn packed']:.3g}", f"{r['speedup_vs_torch']:.2f}x",
             f"{r['lengths_speedup_vs_torch']:.2f}x", f"{r['packed_over_dense']:.2f}"]
            for r in doc.get("packed", [])]


def speech_line(r) -> str:
    """One line of the speech study (bench/speech.py): a cell's bidirectional stack,
    rnnkern's cpu backend and auto against torch.nn, inference and training."""
    parts = []
    for phase in ("forward", "forward_backward"):
        p = r["phases"][phase]
        parts.append(f"{phase.replace('_', '+')} torch.nn {p['ms']['torch.nn']:.3g} ms, rnnkern-cpu "
                     f"{p['speedup_vs_torch']['rnnkern-cpu']:.2f}x, auto "
                     f"{p['speedup_vs_torch']['rnnkern-auto']:.2f}x")
    return (f"{r['cell']} {r['layers']} layers bidirectional B={r['B']} T={r['T']} I={r['I']} H={r['H']}: "
            + "; ".join(parts) + f" (float64 agreement {r['float64_max_difference']:.1e})")


SPEECH_HEADER = ["cell", "B", "T", "I", "H", "layers", "torch.nn fwd (ms)", "rnnkern-cpu fwd",
                 "rnnkern-auto fwd", "torch.nn fwd+bwd (ms)", "rnnkern-cpu fwd+bwd", "rnnkern-auto fwd+bwd"]


def speech_rows(doc) -> list:
    """The speech study's table rows (float32, bidirectional): speed ratios against
    torch.nn, inference (no_grad) and training."""
    rows = []
    for r in doc.get("speech", []):
        row = [r["cell"], str(r["B"]), str(r["T"]), str(r["I"]), str(r["H"]), str(r["layers"])]
        for phase in ("forward", "forward_backward"):
            p = r["phases"][phase]
            row += [f"{p['ms']['torch.nn']:.3g}", f"{p['speedup_vs_torch']['rnnkern-cpu']:.2f}x",
                    f"{p['speedup_vs_torch']['rnnkern-auto']:.2f}x"]
        rows.append(row)
    return rows


def _md_table(header, rows) -> list:
    """A markdown table's lines, and a blank line after it."""
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(row) + " |" for row in rows] + [""])


def markdown(doc) -> str:
    """The summary as markdown tables, with the command and the machine."""
    m = doc["meta"]
    dev = m["device"]
    load = ", ".join(f"{dev[k][0]:.1f}" for k in ("load_average_at_start", "load_average_at_end") if dev.get(k))
    out = [f"`{m['command']}` on {_device_line(doc)}, {m['date']}"
           + (f", load average {load} (start, end)" if load and dev["type"] == "cpu" else "") + ".", "",
           "Speed ratio = torch.nn time / candidate time, measured interleaved in one process "
           "on the same inputs (> 1: faster than torch.nn).", ""]
    for section in SECTIONS:
        for phase in ("forward", "forward_backward"):
            header, rows = _summary(doc, phase, section)
            if not rows:
                continue
            out.append(f"**{_title(phase, section)}**")
            out.append("")
            out += _md_table(header, rows)
    for phase in ("forward", "forward_backward"):
        header, rows = _half_summary(doc, phase)
        if not rows:
            continue
        out.append(f"**{_half_title(phase)}** (each candidate's float32 time / its own half-type time, "
                   "> 1: the half type is faster)")
        out.append("")
        out += _md_table(header, rows)
    rows = packed_rows(doc)
    if rows:
        out.append("**forward + backward: packed batches of skewed lengths** (bench/packed.py, float32; "
                   "speed ratios against torch.nn's packed path; packed / dense: rnnkern's packed time over "
                   "its dense batch of the same number of steps)")
        out.append("")
        out += _md_table(PACKED_HEADER, rows)
    if doc.get("packed_note"):
        out += [f"Packed study not run: {doc['packed_note']}.", ""]
    rows = speech_rows(doc)
    if rows:
        out.append("**speech-sized bidirectional stacks** (bench/speech.py, float32; speed ratios against "
                   "torch.nn; fwd: inference under no_grad)")
        out.append("")
        out += _md_table(SPEECH_HEADER, rows)
    if doc.get("speech_note"):
        out += [f"Speech study not run: {doc['speech_note']}.", ""]
    notes = _not_run_notes(doc)
    if notes:
        out += ["Not run: " + "; ".join(notes) + ".", ""]
    return "\n".join(out)


def _not_run_notes(doc) -> list:
    """Why each candidate that is not available, or that skips a phase, did not run."""
    notes = [f"{c['label']} ({c['note']})" for c in doc["meta"]["candidates"].values() if not c["available"]]
    seen = set()
    for r in doc["results"]:
        for e in r["candidates"].values():
            if e.get("phase_not_run") and e["label"] not in seen:
                seen.add(e["label"])
                notes.append(f"{e['label']} in training ({e['note']})")
    return notes


def write_json(doc, path) -> None:
    """Strict JSON: a NaN or infinity anywhere is a bug and raises here."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


# ----------------------------------------------------------------- plots ----

def _middle(values):
    values = sorted(set(values))
    return values[len(values) // 2]


def _series(results, phase, family, x_key, fixed):
    """{candidate label: [(x, ms)]} over the results of one family, other sizes fixed."""
    out = {}
    for r in results:
        if r["phase"] != phase or family not in r["families"]:
            continue
        if any(r[k] != v for k, v in fixed.items()):
            continue
        for e in r["candidates"].values():
            if e["status"] == "timed":
                out.setdefault(e["label"], []).append((r[x_key], e["median_ms"]))
    return {k: sorted(v) for k, v in out.items()}


def _line_panels(rs):
    """(family, x, fixed sizes, x label) of the time-against-size panels a cell could
    have: batch and hidden size (latency), sequence length (long)."""
    lat = [r for r in rs if "latency" in r["families"]]
    longs = [r for r in rs if "long" in r["families"]]
    panels = []
    if lat:
        H0, B0 = _middle(r["H"] for r in lat), _middle(r["B"] for r in lat)
        T0 = lat[0]["T"]
        panels.append(("latency", "B", {"H": H0, "T": T0}, f"batch (H={H0}, T={T0})"))
        panels.append(("latency", "H", {"B": B0, "T": T0}, f"hidden size (B={B0}, T={T0})"))
    if longs:
        panels.append(("long", "T", {"B": longs[0]["B"], "H": longs[0]["H"]},
                       f"sequence length (B={longs[0]['B']}, H={longs[0]['H']})"))
    return panels


def _panel_has_a_line(rs, panel) -> bool:
    """A panel is drawn only where its size varies: a single point per curve says
    nothing a bar would not say better."""
    family, x_key, fixed, _ = panel
    return any(len({x for x, _ in pts}) >= 2
               for phase in ("forward", "forward_backward")
               for pts in _series(rs, phase, family, x_key, fixed).values())


def _grouped_bars(ax, rs, figure: str, ylabel: str, skip=()):
    """One bar per timed candidate (but ``skip``) at every size of ``rs`` (one
    phase), grouped by size: the candidate's ``figure`` on a log scale."""
    labels = [f"cell B{r['B']} H{r['H']}" if _call(r) == "cell" else f"B{r['B']} T{r['T']} H{r['H']}"
              for r in rs]
    names = []
    for r in rs:
        for n, e in r["candidates"].items():
            if n not in skip and e["status"] == "timed" and e["label"] not in names:
                names.append(e["label"])
    width = 0.8 / max(1, len(names))
    for k, label in enumerate(names):
        ys = []
        for r in rs:
            e = next((e for e in r["candidates"].values() if e["label"] == label), None)
            ys.append(e[figure] if e and e["status"] == "timed" else math.nan)
        ax.bar([x + k * width for x in range(len(rs))], ys, width, label=label)
    ax.set_yscale("log")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rs))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if names:
        ax.legend(fontsize=7)


def plots(doc, outdir) -> list[str]:
    """Time against batch, hidden size and sequence length per cell and dtype, and the
    speed ratio against torch.nn per dtype.  Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    results = doc["results"]
    dev = doc["meta"]["device"]
    baseline = "torch.nn (cuDNN)" if dev["type"] == "cuda" else "torch.nn (oneDNN/ATen)"
    written = []
    cells = sorted({r["cell"] for r in results})
    dtypes = sorted({r["dtype"] for r in results})
    phases = ("forward", "forward_backward")

    for cell in cells:
        for dtype in dtypes:
            rs = [r for r in results if r["cell"] == cell and r["dtype"] == dtype]
            panels = [p for p in _line_panels(rs) if _panel_has_a_line(rs, p)]
            fig, axes = plt.subplots(2, max(1, len(panels)), figsize=(5 * max(1, len(panels)) + (4 if not panels else 0), 8),
                                     squeeze=False)
            for i, phase in enumerate(phases):
                if not panels:  # no size varies alone (e.g. --quick): time at every size measured
                    _grouped_bars(axes[i][0], [r for r in rs if r["phase"] == phase], "median_ms",
                                  "median time (ms)")
                    axes[i][0].set_title(f"{cell} {dtype} {PHASE_LABEL[phase]}: every size measured")
                    continue
                for j, (family, x_key, fixed, xlabel) in enumerate(panels):
                    ax = axes[i][j]
                    for label, pts in _series(rs, phase, family, x_key, fixed).items():
                        xs, ys = zip(*pts)
                        style = "-o" if label.startswith("rnnkern") else "--o" if label == "torch.nn" else ":o"
                        ax.plot(xs, ys, style, label=label, markersize=4)
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.set_xlabel(xlabel)
                    ax.set_ylabel("median time (ms)")
                    ax.set_title(f"{cell} {dtype} {PHASE_LABEL[phase]}")
                    ax.grid(True, which="both", alpha=0.3)
                    ax.legend(fontsize=7)
            fig.suptitle(f"{cell}, {dtype}: time per call on {dev['name']}")
            fig.tight_layout()
            path = outdir / f"time-{cell}-{dtype}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(str(path))

    for dtype in dtypes:
        rows = [(cell, phase) for cell in cells for phase in phases]
        fig, axes = plt.subplots(len(rows), 1, figsize=(14, 3.2 * len(rows)), squeeze=False)
        for ax, (cell, phase) in zip(axes[:, 0], rows):
            rs = [r for r in results if r["cell"] == cell and r["dtype"] == dtype and r["phase"] == phase]
            _grouped_bars(ax, rs, "speedup_vs_torch", f"speed vs {baseline}", skip=(BASELINE,))
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_title(f"{cell} {dtype} {PHASE_LABEL[phase]}: torch.nn time / candidate time (> 1 is faster)")
        fig.tight_layout()
        path = outdir / f"speedup-{dtype}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path))
    return written


# ------------------------------------------------- the studies beside the suite ----

def study_meta(prog: str, argv: Optional[Sequence[str]]) -> dict:
    """The record a study (``python -m bench.resets``, ``bench.packed``, ``bench.rl``)
    writes with its results: when, the command, the commit, the CPU (model name,
    vendor / family / model / stepping, ISA), cores, threads, load and versions."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([f"python -m {prog}"] + list(argv if argv is not None else sys.argv[1:])),
            "git": git_commit(), "cpu": cpu_model(), "cpu_id": cpu_identity(), "isa": cpu_isa(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average_at_start": load_average(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__}}


def write_study(path: Optional[Path], doc: dict) -> None:
    """The study's JSON (``{"meta": ..., ...}``), the load at its end added; nothing
    without a path."""
    doc["meta"]["load_average_at_end"] = load_average()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {path}")
