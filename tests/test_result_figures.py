"""Every figure in the result tables of README.md and docs/*.md is the one its JSON holds.

A result table is announced by a marker comment on the line before it, naming the committed
result files it comes from (paths relative to the page) and, optionally, filters that hold
for the whole table::

    <!-- results: bench/results/cpu-zen5-2026-11-25-headline/bench.json ; threads=2 -->
    | cell | torch.nn forward | rnnkern `cpu` forward | ... |

Each column header names a candidate (``torch.nn``, ``rnnkern `cpu```, ``ONNX Runtime``,
``OpenVINO``, ``torch.nn pieces``, ``rnnkern `resets=```, ``rnnkern packed``, ``rnnkern
`lengths=``` (the packed batch padded) and ``packed / dense`` (its time over a dense batch's
of the same steps)...) and may name a phase
(``forward``, ``forward + backward``) and a thread count (``2 threads``); each row label names
a cell (``LSTM``, ``GRU``, ``RNN (tanh)``) and may name a size (``B=32 T=256 H=256``) and a
dtype.  A cell of the table is then the results that match all of these:

- ``23.7 ms``: that candidate's median time (exactly one result must match);
- ``1.11x``: its speed ratio against torch.nn (one result);
- ``0.93x – 1.12x``: the smallest and the largest ratio over the matching results.

Each figure must equal the JSON's value rounded to the digits printed.  A table whose cells
hold figures (``1.2x``, ``3 ms``) without a marker fails the test: every figure names its
source.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
MARKER = re.compile(r"^<!--\s*results:\s*(?P<files>[^;]*?)\s*(?:;\s*(?P<filters>.*?))?\s*-->$")
FIGURE = re.compile(r"\d(?:\.\d+)?\s*(?:x|ms|µs|us)\b")

CELLS = {"LSTM": "lstm", "GRU": "gru", "RNN (tanh)": "rnn_tanh", "RNN (ReLU)": "rnn_relu", "RNN": "rnn_tanh"}
# Longest first: "torch.nn pieces" before "torch.nn".
CANDIDATES = [("torch.nn pieces", "torch_pieces"), ("rnnkern `resets=`", "resets"),
              ("rnnkern `lengths=`", "lengths"),
              ("packed / dense", "packed_over_dense"), ("rnnkern packed", "packed"),
              ("torch.nn", "torch"), ("rnnkern `cpu`", "cpu"), ("rnnkern `auto`", "auto"),
              ("rnnkern `cuda`", "cuda"),
              ("rnnkern `triton`", "triton"), ("ONNX Runtime", "onnxruntime"), ("OpenVINO", "openvino")]
DTYPES = ("float64", "float32", "bfloat16", "float16")


# ------------------------------------------------------------- the JSON ----

@functools.lru_cache(maxsize=None)
def records(path: Path) -> List[dict]:
    """One flat record per result: cell, call, B, T, H, dtype, phase, threads, and per
    candidate its median ms and speed ratio against torch.nn."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    out = []
    if "torch_pieces_ms" in (data["results"] or [{}])[0]:  # python -m bench.resets
        for r in data["results"]:
            out.append(dict(cell=r["cell"], call="sequence", B=r["B"], T=r["T"], H=r["H"], dtype="float32",
                            phase="forward_backward", threads=meta["threads"],
                            values={"torch_pieces": {"ms": r["torch_pieces_ms"], "x": 1.0},
                                    "resets": {"ms": r["rnnkern_ms"], "x": r["speedup"]}}))
        return out
    if "packed_over_dense" in (data["results"] or [{}])[0]:  # python -m bench.packed
        return [packed_record(r, meta["threads"]) for r in data["results"]]
    threads = meta["device"].get("threads")
    out = [packed_record(r, threads) for r in data.get("packed", [])]  # python -m bench's packed family
    out += [rec for r in data.get("speech", []) for rec in speech_records(r, threads)]  # its speech family
    for r in data["results"]:
        values = {}
        for name, c in r["candidates"].items():
            if c.get("status") == "timed":
                values[name] = {"ms": c["median_ms"], "x": 1.0 if name == "torch" else c["speedup_vs_torch"]}
        out.append(dict(cell=r["cell"], call=r.get("call", "sequence"), B=r["B"], T=r["T"], H=r["H"],
                        dtype=r["dtype"], phase=r["phase"], threads=threads, values=values))
    return out


def packed_record(r: dict, threads) -> dict:
    """A packed study's result (bench/packed.py) as a record: its candidates torch,
    packed, lengths (where measured) and packed_over_dense."""
    return dict(cell=r["cell"], call="sequence", B=r["B"], T=r["T"], H=r["H"], dtype="float32",
                phase="forward_backward", threads=threads,
                values={"torch": {"ms": r["ms"]["torch.nn packed"], "x": 1.0},
                        "packed": {"ms": r["ms"]["rnnkern packed"], "x": r["speedup_vs_torch"]},
                        "packed_over_dense": {"x": r["packed_over_dense"]},
                        **({"lengths": {"ms": r["ms"]["rnnkern lengths="], "x": r["lengths_speedup_vs_torch"]}}
                           if "lengths_speedup_vs_torch" in r else {})})


def speech_records(r: dict, threads) -> List[dict]:
    """A speech study's result (bench/speech.py: a bidirectional stack) as a record per
    phase: its candidates torch, cpu and auto."""
    names = {"torch.nn": "torch", "rnnkern-cpu": "cpu", "rnnkern-auto": "auto"}
    return [dict(cell=r["cell"], call="sequence", B=r["B"], T=r["T"], H=r["H"], dtype="float32",
                 phase=phase, threads=threads,
                 values={names[n]: {"ms": ms, "x": 1.0 if n == "torch.nn" else p["speedup_vs_torch"][n]}
                         for n, ms in p["ms"].items()})
            for phase, p in r["phases"].items()]


# ------------------------------------------------------------ the pages ----

def parse_header(text: str) -> dict:
    """What a column header or row label selects."""
    sel: Dict[str, object] = {}
    rest = text
    for label, name in CANDIDATES:
        if label in rest:
            sel["candidate"] = name
            rest = rest.replace(label, "")
            break
    if "forward + backward" in rest:
        sel["phase"] = "forward_backward"
    elif re.search(r"\bforward\b", rest):
        sel["phase"] = "forward"
    if (threads := re.search(r"(\d+) threads?\b", rest)):
        sel["threads"] = int(threads[1])
    for key in ("B", "T", "H"):
        if (size := re.search(rf"\b{key}=(\d+)", rest)):
            sel[key] = int(size[1])
    if (call := re.search(r"\b(cell|sequence) calls?\b", rest)):
        sel["call"] = call[1]
    for dtype in DTYPES:
        if re.search(rf"\b{dtype}\b", rest):
            sel["dtype"] = dtype
    for label in sorted(CELLS, key=len, reverse=True):
        if re.match(rf"\**{re.escape(label)}(\W|$)", text.strip()):
            sel["cell"] = CELLS[label]
            break
    return sel


def parse_filters(text: Optional[str]) -> dict:
    sel: Dict[str, object] = {}
    for item in (text or "").split():
        key, _, value = item.partition("=")
        sel[key] = int(value) if value.isdigit() else value
    return sel


def split_row(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(page: Path):
    """(line, marker match or None, header, rows) for every table of the page (outside
    code blocks)."""
    lines, fenced, i = page.read_text(encoding="utf-8").splitlines(), False, 0
    while i < len(lines):
        if lines[i].startswith("```"):
            fenced = not fenced
        elif not fenced and lines[i].startswith("|") and i + 1 < len(lines) \
                and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):
            start = i
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            header, rows = split_row(lines[i]), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(split_row(lines[i]))
                i += 1
            yield start + 1, MARKER.match(before), header, rows
            continue
        i += 1


TABLES = [(page, *t) for page in PAGES if page.exists() for t in tables(page)]
MARKED = [t for t in TABLES if t[2] is not None]


def matching(recs: List[dict], sel: dict) -> List[dict]:
    keys = ("cell", "phase", "threads", "B", "T", "H", "dtype", "call")
    return [r for r in recs if all(r[k] == sel[k] for k in keys if k in sel)
            and sel["candidate"] in r["values"]]


def check_figure(text: str, values: List[float], unit: str, where: str) -> None:
    def agrees(printed: str, value: float) -> bool:
        decimals = len(printed.split(".")[1]) if "." in printed else 0
        return abs(value - float(printed)) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12

    numbers = re.findall(r"\d+(?:\.\d+)?", text)
    assert values, f"{where}: no result in the JSON matches"
    if len(numbers) == 2:  # a range: smallest – largest
        low, high = min(values), max(values)
        assert agrees(numbers[0], low) and agrees(numbers[1], high), \
            f"{where}: {text!r}, but the JSON gives {low:.4g}{unit} – {high:.4g}{unit} over {len(values)} results"
    else:
        assert len(numbers) == 1, f"{where}: cannot read {text!r}"
        assert len(values) == 1, f"{where}: {len(values)} results match one figure {text!r}: name the size"
        assert agrees(numbers[0], values[0]), f"{where}: {text!r}, but the JSON gives {values[0]:.4g}{unit}"


def figure_cells(page: Path, line: int, marker, header: List[str], rows: List[List[str]]):
    """(where, text, unit, values) for each figure of a marked table."""
    files = [(page.parent / f).resolve() for f in marker["files"].split()]
    recs = [r for f in files for r in records(f)]
    base = parse_filters(marker["filters"])
    columns = [parse_header(h) for h in header]
    for row in rows:
        row_sel = parse_header(row[0])
        for k, (column, text) in enumerate(zip(columns[1:], row[1:]), 1):
            text = text.replace("*", "").strip()
            if not FIGURE.search(text):
                continue
            sel = {**base, **column, **row_sel}
            where = f"{page.relative_to(ROOT)}:{line}: row {row[0]!r}, column {header[k]!r}"
            assert "candidate" in sel and "cell" in sel, f"{where}: names no candidate or cell"
            unit = "ms" if "ms" in text else "x"
            values = [r["values"][sel["candidate"]][unit] for r in matching(recs, sel)]
            yield where, text, unit, values


# ---------------------------------------------------------------- tests ----

def test_the_pages_have_result_tables():
    readme = [t for t in MARKED if t[0].name == "README.md" and t[0].parent == ROOT]
    assert len(readme) >= 2, "the README shows the latest results in marked tables"


@pytest.mark.parametrize("page, line, marker, header, rows", TABLES,
                         ids=lambda v: v if isinstance(v, int) else (v.name if isinstance(v, Path) else ""))
def test_a_table_of_figures_names_its_json(page, line, marker, header, rows):
    has_figures = any(FIGURE.search(c) for row in rows for c in row[1:])
    if has_figures:
        assert marker, f"{page.relative_to(ROOT)}:{line}: a table of figures without a " \
                       f"'<!-- results: FILE.json -->' marker naming its source"
    if marker:
        for f in marker["files"].split():
            path = (page.parent / f).resolve()
            assert path.is_file() and path.is_relative_to(ROOT / "bench" / "results"), \
                f"{page.relative_to(ROOT)}:{line}: {f} is no committed result file"
            assert not made_from_uncommitted_code(path), \
                f"{page.relative_to(ROOT)}:{line}: {f} was measured from a tree with uncommitted " \
                f"changes (its git field ends in -dirty): publish a run of committed code"


def made_from_uncommitted_code(path: Path) -> bool:
    return str(json.loads(path.read_text())["meta"].get("git") or "").endswith("-dirty")


def test_a_run_from_a_dirty_tree_is_told_apart():
    results = ROOT / "bench" / "results"
    assert made_from_uncommitted_code(results / "gpu-h100-2026-11-27" / "bench-cuda-grid" / "bench_cuda_grid.json")
    assert not made_from_uncommitted_code(results / "gpu-h100-2026-11-27-session4" / "bench-cuda-grid" / "bench_gpu.json")


@pytest.mark.parametrize("page, line, marker, header, rows", MARKED,
                         ids=lambda v: v if isinstance(v, int) else (v.name if isinstance(v, Path) else ""))
def test_every_figure_is_the_json_s(page, line, marker, header, rows):
    checked = 0
    for where, text, unit, values in figure_cells(page, line, marker, header, rows):
        check_figure(text, values, unit, where)
        checked += 1
    assert checked, f"{page.relative_to(ROOT)}:{line}: a marked table without figures"


def test_the_check_catches_a_wrong_figure_and_an_ambiguous_one():
    check_figure("1.11x", [1.1078], "x", "here")
    check_figure("0.93x – 1.12x", [1.0, 0.934, 1.117], "x", "here")
    with pytest.raises(AssertionError, match="the JSON gives"):
        check_figure("1.12x", [1.1078], "x", "here")
    with pytest.raises(AssertionError, match="the JSON gives"):
        check_figure("0.93x – 1.12x", [1.0, 0.92, 1.117], "x", "here")
    with pytest.raises(AssertionError, match="name the size"):
        check_figure("23.7 ms", [23.7, 24.0], "ms", "here")
    assert parse_header("rnnkern `cpu` forward + backward, 2 threads") == \
        {"candidate": "cpu", "phase": "forward_backward", "threads": 2}
    assert parse_header("**GRU B=1 T=256 H=128**") == {"B": 1, "T": 256, "H": 128, "cell": "gru"}
