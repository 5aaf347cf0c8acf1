"""Measured efficiencies: a result file of ``python -m moe_ep.bench kernels`` (the JSON it writes
to ``benchmarks/results/``, or a ``scripts/gpu_check.sh`` result, which holds one) from the user's
own GPU replaces the default efficiencies of
``moe_ep.planner.presets``:

- grouped GEMMs: moe_ep's experts op (``moe_ep[triton]``, else ``moe_ep[torch]``), forward +
  backward, uniform routing, at the largest token count measured; of a gate that timed several
  expert problems, the one nearest the planned model's expert shape;
- dense GEMMs: the bench's ``dense_mm`` chain with the same FLOPs;
- memory-bound kernels: the device-to-device copy's bandwidth;
- attention: of a gate with the ``attention`` step (``moe_ep.bench.attention``), causal SDPA
  forward + backward on the backend SDPA picks itself, at the measured model's attention nearest
  the planned one's; else its default stays (the report says so).

Each is the measured TFLOP/s (or GB/s) over the cluster's peak. The file must come from a GPU of
the cluster's kind (its device name contains the GPU family, e.g. "A100") and be measured in a
16-bit dtype; anything else is refused with the reason."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from .presets import Efficiencies

_HALF = ("bfloat16", "float16")


def _pick(rows, kind, variants, phase):
    """The uniform-routing row of the first available variant at the largest T."""
    for variant in variants:
        found = [r for r in rows if r.get("kind") == kind and r.get("variant") == variant
                 and r.get("phase") == phase and r.get("status") == "ok" and r.get("routing") in ("uniform", None)]
        if found:
            return max(found, key=lambda r: r.get("T") or 0)
    return None


def _problems(kernels: dict) -> dict[str, dict] | None:
    """A gate that timed several expert problems keeps a meta per problem (its device, its
    "H=... I=... E=... k=... dtype" shape) and rows marked with the problem: those metas by name,
    the first Mixtral-8x7B's; None for a result of one problem."""
    meta = kernels.get("meta") or {}
    if "device" in meta or not meta or not all(isinstance(m, dict) for m in meta.values()):
        return None
    return meta


def _rows_of(kernels: dict, name: str) -> dict:
    rows = [r for r in kernels.get("rows") or [] if isinstance(r, dict) and r.get("problem", name) == name]
    return dict(kernels, meta=kernels["meta"][name], rows=rows)


def _expert_sizes(meta: dict) -> tuple[int, int] | None:
    """(H, I) of a problem's meta shape, None when it does not say."""
    words = dict(w.split("=", 1) for w in str(meta.get("shape", "")).split() if "=" in w)
    try:
        return int(words["H"]), int(words["I"])
    except (KeyError, ValueError):
        return None


def nearest_problem(problems: dict[str, dict], expert_sizes: tuple[int, int] | None) -> str:
    """The problem whose experts' GEMMs are closest to ``expert_sizes`` (a model's hidden size and
    expert width): the smallest sum of the two size ratios' log distances, the first on a tie or
    when the model has no experts. Grouped GEMMs run at very different rates by shape (Mixtral's
    4096 x 14336 near the dense rate, Qwen3-30B-A3B's 2048 x 768 a quarter lower on the H200)."""
    first = next(iter(problems))
    if expert_sizes is None:
        return first

    def distance(name: str) -> float:
        sizes = _expert_sizes(problems[name])
        if sizes is None:
            return math.inf
        return sum(abs(math.log(want / got)) for want, got in zip(expert_sizes, sizes))

    return min(problems, key=lambda name: (distance(name), name != first))


def nearest_attention(rows: list[dict], attention_dims: tuple[int, int, int] | None) -> dict | None:
    """The row of ``rows`` (the attention step's, one model each) whose attention is closest to
    ``attention_dims`` (heads, query/key and value head sizes): the smallest sum of the three log
    distances; the first row without dims; None without rows."""
    if not rows or attention_dims is None:
        return rows[0] if rows else None

    def distance(row: dict) -> float:
        return sum(abs(math.log(want / row[key])) for want, key in zip(attention_dims, ("heads", "qk_dim", "v_dim")))

    return min(rows, key=distance)


def _attention_row(payload: dict, attention_dims: tuple[int, int, int] | None) -> dict | None:
    """A gate's attention step: SDPA's own backend, measured, at the model nearest ``attention_dims``."""
    attention = ((payload.get("meta") or {}).get("results") or {}).get("attention")
    rows = [r for r in (attention or {}).get("rows") or [] if isinstance(r, dict) and r.get("kind") == "attention"
            and r.get("variant") == "sdpa[default]" and r.get("status") == "ok"
            and all(isinstance(r.get(k), int) and r[k] > 0 for k in ("heads", "qk_dim", "v_dim"))]
    return nearest_attention(rows, attention_dims)


def read_calibration(path, *, gpu_family: str, peak_tflops: float, hbm_gbps: float,
                     defaults: Efficiencies, expert_sizes: tuple[int, int] | None = None,
                     attention_dims: tuple[int, int, int] | None = None) -> Efficiencies:
    """The efficiencies measured in ``path``, the defaults' for what it does not measure. From a
    gate that timed several expert problems, the grouped-GEMM rate is the problem's nearest to
    ``expert_sizes`` (the model's hidden size and expert width; :func:`nearest_problem`); the dense
    and memory rates stay the first problem's (Mixtral-8x7B's dense chain and copy); the attention
    rate is the measured model's nearest to ``attention_dims`` (:func:`nearest_attention`)."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"calibration file {str(path)!r} cannot be read: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"calibration file {str(path)!r} is not JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError as err:  # a binary file: JSON is UTF-8 text
        raise ValueError(f"calibration file {str(path)!r} is not JSON (not UTF-8 text: byte {err.start} "
                         f"is {err.object[err.start:err.start + 1]!r})") from None
    try:
        return _measured(path, payload, gpu_family, peak_tflops, hbm_gbps, defaults, expert_sizes, attention_dims)
    except (AttributeError, TypeError, KeyError, IndexError, ZeroDivisionError) as err:
        # A hand-made or damaged file: its fields are not what the bench writes.
        raise ValueError(f"calibration file {str(path)!r} does not hold a result of 'python -m moe_ep.bench kernels' "
                         f"or scripts/gpu_check.sh as they write it ({type(err).__name__}: {err})") from None


def _measured(path: Path, payload, gpu_family, peak_tflops, hbm_gbps, defaults, expert_sizes,
              attention_dims) -> Efficiencies:
    """``read_calibration`` of the file's JSON ``payload``."""
    grouped_rows = attention_row = None
    if isinstance(payload, dict) and payload.get("mode") == "gpu_check":
        attention_row = _attention_row(payload, attention_dims)
        # scripts/gpu_check.sh keeps the kernels bench's result, meta and rows, inside its own.
        kernels = ((payload.get("meta") or {}).get("results") or {}).get("kernels")
        problems = _problems(kernels) if isinstance(kernels, dict) else None
        if problems is not None:
            kernels = dict(kernels, mode="kernels")
            grouped_rows = _rows_of(kernels, nearest_problem(problems, expert_sizes))["rows"]
            payload = _rows_of(kernels, next(iter(problems)))
        elif isinstance(kernels, dict):
            payload = dict(kernels, mode="kernels")
    if not isinstance(payload, dict) or payload.get("mode") != "kernels" or not isinstance(payload.get("rows"), list):
        mode = payload.get("mode") if isinstance(payload, dict) else None
        raise ValueError(
            f"calibration file {str(path)!r} must be a result of 'python -m moe_ep.bench kernels' (mode 'kernels' "
            f"with rows) or of scripts/gpu_check.sh (mode 'gpu_check' holding one), got mode {mode!r}"
        )
    meta = payload.get("meta") or {}
    device = str(meta.get("device", ""))
    if gpu_family.lower() not in device.lower():
        raise ValueError(
            f"calibration file {str(path)!r} was measured on {device!r}, not on a {gpu_family}: run "
            f"'python -m moe_ep.bench kernels' on the cluster's GPU, or plan for the GPU it measured"
        )
    dtype = str(meta.get("shape", "")).split()[-1:] or [""]
    if dtype[0] not in _HALF:
        raise ValueError(
            f"calibration file {str(path)!r} was measured in {dtype[0] or 'an unknown dtype'!r}; the planner models "
            f"16-bit training: run the bench with --dtype bfloat16"
        )
    rows, name = payload["rows"], path.name
    measured, sources = {}, dict(defaults.sources)
    picks = {
        "grouped_gemm": (_pick(rows if grouped_rows is None else grouped_rows, "op", ("moe_ep[triton]", "moe_ep[torch]"),
                               "fwd+bwd"), "tflops", peak_tflops),
        "dense_gemm": (_pick(rows, "dense", ("dense_mm",), "fwd+bwd"), "tflops", peak_tflops),
        "memory": (_pick(rows, "copy", ("device_copy",), "copy"), "gbps", hbm_gbps),
        "attention": (attention_row, "tflops", peak_tflops),
    }
    for kind, (row, key, peak) in picks.items():
        if row is None or not isinstance(row.get(key), (int, float)):
            sources[kind] = f"default, not in {name}: {defaults.source(kind)}"
            continue
        value = row[key] / peak
        unit = "TFLOP/s" if key == "tflops" else "GB/s"
        if kind == "attention":
            what = f"{row['variant']} {row['phase']} of {row['model']}'s attention at {row['tokens']} tokens"
        else:
            # The problem measured, which may not be the planned model's experts: said with the rate.
            shape = row.get("problem") or meta.get("shape")
            what = (f"{row['variant']} {row['phase']}" + (f" at T={row['T']}" if row.get("T") else "")
                    + (f" of {shape}" if shape else ""))
        if not value > 0:  # NaN too
            raise ValueError(f"calibration file {str(path)!r}: {what} holds the rate {row[key]!r} {unit}, not a "
                             "positive number: the file is damaged")
        if not value <= 1:
            raise ValueError(
                f"calibration file {str(path)!r}: {what} measured {row[key]:.1f} {unit}, {value:.2f} x the cluster's "
                f"peak of {peak:g} {unit}: the peak given for the cluster is not this GPU's"
            )
        measured[kind] = value
        sources[kind] = f"measured: {name}, {device}, {what}: {row[key]:.1f} {unit} of {peak:g}"
    if not measured:
        raise ValueError(f"calibration file {str(path)!r} calibrates nothing: none of its rows is a measured rate of "
                         "the grouped GEMMs (fwd+bwd), the dense GEMM (fwd+bwd) or the device copy")
    if "attention" not in measured:
        sources["attention"] = f"default, not measured in {name} (the gate's attention step): " \
                               f"{defaults.source('attention')}"
    return dataclasses.replace(defaults, **measured, sources=tuple(sources.items()))
