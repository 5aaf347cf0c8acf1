"""What the user sees: per-step loss, auxiliary loss, gradient norm, tokens/s, estimated MFU and the
per-layer expert load; a progress bar, a JSON-lines log (``metrics.jsonl``), optional TensorBoard, and
a final summary (Reporter). StepLog is the same log, one line per step, for loops whose own library
reports the rest (transformers' Trainer, accelerate)."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import RunError, write_failure
from .ownership import METRICS, make_managed_dir, marker_info

# Peak dense bf16 tensor-core TFLOP/s by device name (vendor data sheets, without sparsity).
PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "A800": 312.0, "L40S": 362.0,
               "B200": 2250.0}


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device, or None where unknown (the CPU): MFU is then not reported."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def flops_per_token(config, active_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per active weight (forward 2, backward 4), embedding lookups
    excluded, plus attention scores and values, 12 * layers * (heads * head_dim) * seq_len (causal
    masking is not discounted, as in the PaLM and Megatron MFU conventions)."""
    embed = config.vocab_size * config.hidden_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
    return 6 * (active_params - embed) + attn


LAYER = re.compile(r"layers\.(\d+)\.")


class ExpertLoad:
    """Counts, per layer, how many routed slots each expert receives.

    Forward hooks on the MoE blocks' routers read the chosen expert ids (the router's last output),
    so what is counted is the routing that actually ran, with any kernel. Counts accumulate on the
    device with no host sync; ``collect`` sums them over all ranks (each rank routes its own tokens;
    with pipeline stages each layer lives on one stage).

    ``pipeline``: torch's pipeline stages run their first micro-batch once more before the first
    step, to infer the shapes they exchange; that pass is not training and is not counted."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int, device, *, pipeline: bool = False):
        self.counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self._uncounted = set(range(num_layers)) if pipeline else set()
        self._handles = []
        for name, module in model.named_modules():
            gate = getattr(module, "gate", None)
            if gate is None or not hasattr(module, "experts"):
                continue
            layer = LAYER.search(name + ".")
            if layer is None:
                raise ValueError(f"cannot tell the layer index of the MoE block {name!r}")
            self._handles.append(gate.register_forward_hook(self._hook(int(layer[1]), name)))
        if not self._handles:
            raise ValueError("found no MoE block (a module with .gate and .experts) to watch")

    def _hook(self, layer: int, name: str):
        def hook(_module, _inputs, output):
            if not (isinstance(output, tuple) and not output[-1].is_floating_point()):
                raise TypeError(
                    f"the router of {name} returned {type(output).__name__}; expected a tuple ending in expert ids"
                )
            if layer in self._uncounted:
                self._uncounted.discard(layer)
                return
            idx = output[-1].reshape(-1).long()
            self.counts_LE[layer].scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.float64))
        return hook

    def collect(self) -> torch.Tensor:
        """Global counts since the last call, ``[layers, experts]`` on the CPU; collective."""
        counts = self.counts_LE.clone()
        if dist.is_initialized():
            dist.all_reduce(counts)
        self.counts_LE.zero_()
        # host sync: once per log interval, for printing.
        return counts.cpu()


def balance(counts_LE: torch.Tensor) -> list[float | None]:
    """Per layer, the busiest expert's load over the mean load (1.0 = perfectly even); None for a
    layer that routed nothing: a dense layer (DeepSeek-V3's first ones) has no load to balance."""
    ratios = counts_LE.max(-1).values / counts_LE.mean(-1).clamp_min(1e-12)
    routed = counts_LE.sum(-1) > 0
    return [ratio if moe else None for ratio, moe in zip(ratios.tolist(), routed.tolist())]


def resume_record(step: int, checkpoint: Path | None, set_aside: Path | None) -> tuple[dict, str | None]:
    """What a log says of a resume at ``step``: a record that supersedes its earlier records of
    later steps (read_metrics), which the resumed run trains again or which belong to an abandoned
    branch, and where checkpoints were set aside (rolled back), a line saying where they are. A
    run that starts afresh over an earlier one's log (killed before its first checkpoint) is a
    resume at step 0 from no checkpoint."""
    record = {"resumed_from_step": step, "checkpoint": None if checkpoint is None else str(checkpoint),
              "set_aside": None if set_aside is None else str(set_aside)}
    if set_aside is None:
        return record, None
    later = ", ".join(sorted(p.name for p in set_aside.iterdir() if p.is_dir()))
    left = marker_info(set_aside).get("from_step", step)
    if left != step:  # a branch set aside earlier, taken up again by its path (checkpoint.branch_step)
        return record, (f"took up the branch of {checkpoint} at step {step}: the checkpoints made after step {left} "
                        f"on the other branch ({later}) are set aside, not deleted, in {set_aside}")
    return record, (f"rolled back to step {step}: the later checkpoints ({later}) are set aside, not deleted, in "
                    f"{set_aside}; this run goes on from {checkpoint}")


def json_line(record: dict) -> str:
    """``record`` as one line of JSON, a non-finite float (a diverged step's loss or gradient norm)
    written as null: NaN and Infinity are not JSON, and other readers reject or misread them."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, list):
            return [finite(v) for v in value]
        return value

    return json.dumps({key: finite(value) for key, value in record.items()}, allow_nan=False) + "\n"


def trim_cut_line(path: Path) -> bool:
    """Before a run appends to its log: a last line cut short (a run killed mid-write) is removed,
    so that the next record starts a line of its own. Whether the log holds any record."""
    try:
        with open(path, "rb+") as f:
            end = pos = f.seek(0, os.SEEK_END)
            keep = 0
            while pos > 0:
                start = max(0, pos - 4096)
                f.seek(start)
                newline = f.read(pos - start).rfind(b"\n")
                if newline >= 0:
                    keep = start + newline + 1
                    break
                pos = start
            if keep < end:
                f.truncate(keep)
            return keep > 0
    except FileNotFoundError:
        return False
    except OSError as err:
        raise RunError(write_failure(path, err)) from None


class Reporter:
    """Rank 0 prints and writes; the other ranks only take part in collectives."""

    def __init__(self, output_dir: Path, *, enabled: bool, total_steps: int, progress: bool, tensorboard: bool):
        self.enabled = enabled
        self.bar = None
        self.tb = None
        self.tb_dir = None
        self.jsonl = None
        if not enabled:
            return
        self.jsonl_path = output_dir / METRICS
        self.continues_a_log = trim_cut_line(self.jsonl_path)
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(self.jsonl_path, "a", buffering=1)
        except OSError as err:
            raise RunError(write_failure(self.jsonl_path, err)) from None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, disable=None)
        self.tb_dir = make_managed_dir(output_dir / "tensorboard", "tensorboard") if tensorboard else None

    def resumed(self, step: int, checkpoint: Path, set_aside: Path | None) -> None:
        """A resume at ``step`` (resume_record)."""
        if not self.enabled:
            return
        record, line = resume_record(step, checkpoint, set_aside)
        self._write(record)
        if line:
            self.info(line)

    def started_afresh(self) -> None:
        """A run from step 0 over an earlier run's log: its records are superseded (resume_record)."""
        if self.enabled and self.continues_a_log:
            self._write(resume_record(0, None, None)[0])

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def _write(self, record: dict) -> None:
        try:
            self.jsonl.write(json_line(record))
        except OSError as err:
            raise RunError(write_failure(self.jsonl_path, err)) from None

    def skipped(self, record: dict, max_consecutive: int) -> None:
        """A step that TrainStep skipped (non-finite loss or gradient norm on some rank): one line
        and a record with ``"skipped": true``."""
        if not self.enabled:
            return
        self._write({**record, "skipped": True})
        stop = f" (the run stops at {max_consecutive})" if max_consecutive else ""
        self.info(f"step {record['step']:>6} | skipped: loss {record['loss']:.4g}, grad_norm {record['grad_norm']:.4g} "
                  f"(not finite on some rank); nothing applied | {record['consecutive_skips']} in a row{stop}, "
                  f"{record['steps_skipped']} in all")
        if self.bar is not None:
            self.bar.update(record["step"] - self.bar.n)

    def step(self, record: dict, load_LE: torch.Tensor | None) -> None:
        if not self.enabled:
            return
        if load_LE is not None:
            record["expert_load_max_over_mean"] = [None if b is None else round(b, 4) for b in balance(load_LE)]
            record["expert_load"] = load_LE.tolist()
        self._write(record)
        # None: not computed (no load-balancing loss, --aux-loss-coef 0).
        aux = "n/a" if record["aux_loss"] is None else f"{record['aux_loss']:.4f}"
        z = "" if record.get("z_loss") is None else f" | z {record['z_loss']:.4f}"
        line = (
            f"step {record['step']:>6} | loss {record['loss']:.4f} | aux {aux}{z} "
            f"| grad_norm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s"
        )
        line += f" | MFU {100 * record['mfu']:.1f}%" if record.get("mfu") is not None else ""
        if load_LE is not None:
            per_layer = balance(load_LE)
            moe = {layer: b for layer, b in enumerate(per_layer) if b is not None}
            if len(per_layer) <= 8:
                line += " | expert load max/mean per layer " + " ".join(
                    "-" if b is None else f"{b:.2f}" for b in per_layer
                )
            elif moe:
                worst = max(moe, key=moe.__getitem__)
                line += (f" | expert load max/mean: layer mean {sum(moe.values()) / len(moe):.2f}, "
                         f"worst {moe[worst]:.2f} (layer {worst})")
        self.info(line)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            self.bar.update(record["step"] - self.bar.n)
        if self.tb_dir is not None and self.tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # Opened at the first step this run logs: the events of that step and later ones that
            # earlier runs wrote into the folder (steps run again after a crash, an abandoned
            # branch's) are purged from what TensorBoard shows, as read_metrics drops their records.
            self.tb = SummaryWriter(str(self.tb_dir), purge_step=record["step"])
        if self.tb is not None:
            for key in ("loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens_per_s", "mfu"):
                if record.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", record[key], record["step"])
            if load_LE is not None:
                for layer, b in enumerate(balance(load_LE)):
                    if b is not None:
                        self.tb.add_scalar(f"expert_load_max_over_mean/layer{layer}", b, record["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()


def read_metrics(path: Path) -> list[dict]:
    """The step records of a ``metrics.jsonl`` as the run's history stands: a resume record
    (``resumed_from_step: N``) drops the records of steps after N written before it, steps run again
    after a crash or an abandoned branch's, so that no step is counted twice. A resume from a
    checkpoint of a branch set aside earlier (a folder a resume record named) takes up that
    branch's records as they stood when it was set aside, up to N. A last line cut short (a run
    killed mid-write) is ignored; any other line that is not JSON raises ValueError naming it."""
    lines = path.read_text().splitlines()
    records: list[dict] = []
    # Each set-aside folder's line as it stood when it was set aside, by the folder's name (its
    # own, unique in the checkpoint folder, which stays the same where the run folder is moved).
    branches: dict[str, list[dict]] = {}
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not a JSON record: {line[:80]!r}") from None
        if "resumed_from_step" in record:
            step, checkpoint = record["resumed_from_step"], record.get("checkpoint")
            line_before = records
            if checkpoint is not None and Path(checkpoint).parent.name in branches:
                line_before = branches[Path(checkpoint).parent.name]
            if record.get("set_aside") is not None:
                branches[Path(record["set_aside"]).name] = records
            records = [r for r in line_before if r["step"] <= step]
        elif "step" in record:
            records.append(record)
    return records


class Throughput:
    """Tokens/s and MFU over the steps since the last report, excluding checkpoint time."""

    def __init__(self, flops_per_token: float, peak: float | None, world_size: int):
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world_size = world_size
        self.tokens = 0
        self.seconds = 0.0
        self.total_tokens = 0
        self.total_seconds = 0.0
        self._t0 = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, tokens: int) -> None:
        dt = time.perf_counter() - self._t0
        self.tokens += tokens
        self.seconds += dt
        self.total_tokens += tokens
        self.total_seconds += dt

    def report(self) -> tuple[float, float | None]:
        tps = self.tokens / max(self.seconds, 1e-9)
        mfu = tps * self.flops_per_token / (self.peak * self.world_size) if self.peak else None
        self.tokens, self.seconds = 0, 0.0
        return tps, mfu

    def mean_mfu(self) -> float | None:
        if not self.peak or not self.total_seconds:
            return None
        return self.total_tokens / self.total_seconds * self.flops_per_token / (self.peak * self.world_size)


def summary_lines(*, losses: list[tuple[int, float]], throughput: Throughput, wall_s: float, extra: dict) -> list[str]:
    lines = ["", "=== summary ==="]
    if losses:
        first, last = losses[0], losses[-1]
        window = max(1, len(losses) // 10)
        head = sum(v for _, v in losses[:window]) / window
        tail = sum(v for _, v in losses[-window:]) / window
        lines.append(f"loss: step {first[0]} {first[1]:.4f} -> step {last[0]} {last[1]:.4f} "
                     f"(mean of first/last {window} step(s): {head:.4f} -> {tail:.4f})")
    tps = throughput.total_tokens / max(throughput.total_seconds, 1e-9)
    lines.append(f"tokens trained: {throughput.total_tokens:,} in {throughput.total_seconds:.1f} s of steps "
                 f"({tps:,.0f} tok/s), {wall_s:.1f} s wall")
    mfu = throughput.mean_mfu()
    lines.append(f"estimated MFU: {100 * mfu:.1f}%" if mfu is not None
                 else "estimated MFU: n/a (unknown peak FLOP/s for this device; pass --peak-tflops)")
    if torch.cuda.is_available():
        lines.append(f"peak GPU memory (rank 0): {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return lines


class StepLog:
    """One line per optimizer step on rank 0, and the same figures in ``metrics.jsonl`` (appended
    to by a resumed run)."""

    def __init__(self, folder: Path, enabled: bool):
        self.path = folder / METRICS
        self.enabled = enabled
        self._continues_a_log = None  # known at the first write, once the folder is the run's

    def resumed(self, step: int, checkpoint: Path, set_aside: Path | None) -> None:
        """A resume at ``step`` (resume_record)."""
        if not self.enabled:
            return
        record, line = resume_record(step, checkpoint, set_aside)
        self._append(record)
        self.info(f"resumed from {checkpoint} at step {step}")
        if line:
            self.info(line)

    def started_afresh(self) -> None:
        """A run from step 0 over an earlier run's log: its records are superseded (resume_record)."""
        if self.enabled and self._trimmed():
            self._append(resume_record(0, None, None)[0])

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        grad_norm = record.get("grad_norm")
        print(f"step {record['step']:5d} | loss {record['loss']:.6f} | grad_norm "
              f"{'-' if grad_norm is None else f'{grad_norm:.4f}'} | lr {record['lr']:.2e}", flush=True)
        self._append(record)

    def _trimmed(self) -> bool:
        """The log's cut-short last line removed (once); whether it holds records of earlier runs."""
        if self._continues_a_log is None:
            self._continues_a_log = trim_cut_line(self.path)
        return self._continues_a_log

    def _append(self, record: dict) -> None:
        self._trimmed()
        try:
            with open(self.path, "a") as f:
                f.write(json_line(record))
        except OSError as err:
            raise RunError(write_failure(self.path, err)) from None

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def warn(self, message: str) -> None:
        if self.enabled:
            print(f"warning: {message}", file=sys.stderr, flush=True)
