"""What every benchmark mode hands back, how it is printed and where it is saved: a table on
stdout no wider than 120 columns, and ``<mode>_<device>_<date>.{json,csv,png}`` in the results
folder."""

from __future__ import annotations

import csv
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

# Where results go unless --out-dir says otherwise: a git-ignored folder, so that trying a
# benchmark never changes the checkout. The GPU gate writes to the committed folder instead: its
# results are the measured record the cost model and the README quote.
RESULTS_DIR = Path("bench-results")
COMMITTED_RESULTS_DIR = Path("benchmarks/results")


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = "{}"  # applied to numbers; None and NaN print as "-"


@dataclass
class Report:
    mode: str
    device: torch.device
    columns: list[Column]
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed under the table and saved in the JSON
    plot: Callable[["Report", Path], None] | None = None
    formats: tuple[str, ...] = (".json", ".csv", ".png")  # the files ``save`` writes
    failed: list[str] = field(default_factory=list)  # checks that failed: the command exits with 1


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        models = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        if models:
            cpu = models[0].strip()
    return f"{cpu} ({torch.get_num_threads()} threads)"


def environment(device: torch.device) -> dict:
    import transformers
    import triton

    return {
        "device": device_name(device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
    }


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def results_stem(report: Report) -> str:
    name = torch.cuda.get_device_name(report.device) if report.device.type == "cuda" else "cpu"
    return f"{report.mode}_{slug(name)}_{datetime.date.today().isoformat()}"


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


TABLE_WIDTH = 120  # columns a printed table may use: a terminal beside an editor
LONG_CELL = 32  # longer texts (reasons a variant did not run) become numbered footnotes


def format_table(report: Report, width: int = TABLE_WIDTH) -> str:
    """The rows as text no wider than ``width``: columns that do not fit go to further blocks,
    each repeating the leading columns that name a row (those without a number format), and
    long texts become footnotes under the table; notes are wrapped to ``width``."""
    footnotes: dict[str, int] = {}

    def cell(row: dict, column: Column) -> str:
        text = _cell(row.get(column.key), column.fmt)
        if len(text) <= LONG_CELL:
            return text
        return f"[{footnotes.setdefault(text, len(footnotes) + 1)}]"

    cells = [[c.header for c in report.columns]] + [[cell(row, c) for c in report.columns] for row in report.rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(report.columns))]
    n_index = next((i for i, c in enumerate(report.columns) if c.fmt != "{}"), 0)
    blocks, block = [], list(range(n_index))
    for i in range(n_index, len(report.columns)):
        if len(block) > n_index and sum(widths[j] + 2 for j in block) + widths[i] > width:
            blocks.append(block)
            block = list(range(n_index))
        block.append(i)
    blocks.append(block)
    lines = []
    for block in blocks:
        if lines:
            lines.append("")
        rows = [[r[i].rjust(widths[i]) for i in block] for r in cells]
        rows.insert(1, ["-" * widths[i] for i in block])
        lines += ["  ".join(r) for r in rows]
    lines += [_wrapped(f"[{n}] {text}", width) for text, n in footnotes.items()]
    lines += [_wrapped(f"note: {note}", width) for note in report.notes]
    return "\n".join(lines)


def first_line(err: BaseException, limit: int = 200) -> str:
    """What a row says of an exception: its message's first line, cut to ``limit`` characters
    (an exception may carry no message at all)."""
    return (str(err).splitlines() or [""])[0][:limit]


def _wrapped(text: str, width: int) -> str:
    return textwrap.fill(text, width, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)


def check_out_dir(out_dir: Path) -> None:
    """Before a run: ``out_dir`` exists (made if missing) and takes a file, so that a run's results
    are never lost to a folder found unwritable only at its end."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as err:
        raise ValueError(f"--out-dir {out_dir} cannot hold the results ({err.strerror or err}); choose another "
                         "folder, or --no-save") from None


def _claim_stem(out_dir: Path, stem: str, suffixes: tuple[str, ...]) -> Path:
    """``out_dir / stem``, or ``stem-2``, ``stem-3``, ... where another run of the day wrote one of
    its files (or a link of that name lies there), claimed by creating its first file exclusively:
    a run never writes over another's results, even saving at the same moment."""
    n = 1
    while True:
        candidate = out_dir / (stem if n == 1 else f"{stem}-{n}")
        if not any(os.path.lexists(candidate.with_suffix(suffix)) for suffix in suffixes):
            try:
                candidate.with_suffix(suffixes[0]).open("x").close()
                return candidate
            except FileExistsError:
                pass  # another run took it between the look and the claim
        n += 1


def _write_replacing(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` to a temporary file beside ``path``, then renamed over it: a run killed while
    saving leaves the claimed file empty, never a truncated one a later reader takes for whole."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # the suffix kept: matplotlib reads it
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _json_safe(value):
    """``value`` with every NaN or infinite float as None (null): strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def save(report: Report, out_dir: Path) -> list[Path]:
    """Write the report's formats: JSON (meta, notes and rows), CSV (rows) and, when the mode draws
    one, a PNG, under a name no other run's files hold (``_claim_stem``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = _claim_stem(out_dir, results_stem(report), report.formats)
    paths = []
    if ".json" in report.formats:
        paths.append(stem.with_suffix(".json"))
        payload = {"mode": report.mode, "meta": report.meta, "notes": report.notes, "rows": report.rows}
        text = json.dumps(_json_safe(payload), indent=1, default=str, allow_nan=False) + "\n"
        _write_replacing(paths[-1], lambda tmp: tmp.write_text(text))
    if ".csv" in report.formats:
        paths.append(stem.with_suffix(".csv"))
        _write_replacing(paths[-1], lambda tmp: _write_csv(report.rows, tmp))
    if ".png" in report.formats and report.plot is not None and report.rows:
        if importlib.util.find_spec("matplotlib") is None:
            # The figure is the one optional output: a run on a machine without matplotlib still
            # writes its results (and the GPU gate its verdict), and says what is missing.
            print("no figure: matplotlib is not installed (pip install 'moe_ep[bench]')", file=sys.stderr)
        else:
            paths.append(stem.with_suffix(".png"))
            _write_replacing(paths[-1], lambda tmp: report.plot(report, tmp))
    return paths


def _write_csv(rows: list[dict], path: Path) -> None:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def new_figure(nrows: int, ncols: int, *, width: float = 5.0, height: float = 3.6):
    """A matplotlib figure drawn off screen (the benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes


def close_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
