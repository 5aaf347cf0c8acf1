"""Load pretrained weights into a sharded model, each rank reading only the slices it owns.

safetensors files are memory-mapped and ``safe_open(...).get_slice(name)[...]`` reads just the
requested region, so a rank holding 2 of 8 experts (and 1/4 of the dense weights) touches about a
quarter of the checkpoint, never all of it. Fused names (``experts.gate_up_proj [E, 2I, H]``) are
read as they are; legacy per-expert checkpoints (Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2``,
Qwen-style ``mlp.experts.N.gate_proj/up_proj/down_proj``) are assembled from the owned experts'
tensors only.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from moe_ep.runs import UsageError

from models import local_chunk

# Per-expert names of a legacy checkpoint: (gate, up, down) given the layer prefix and expert id.
LEGACY_EXPERTS = (
    ("{p}.block_sparse_moe.experts.{e}.w1.weight", "{p}.block_sparse_moe.experts.{e}.w3.weight",
     "{p}.block_sparse_moe.experts.{e}.w2.weight"),
    ("{p}.mlp.experts.{e}.gate_proj.weight", "{p}.mlp.experts.{e}.up_proj.weight",
     "{p}.mlp.experts.{e}.down_proj.weight"),
)
LEGACY_RENAMES = ((re.compile(r"\.mlp\.gate\.weight$"), ".block_sparse_moe.gate.weight"),)
FUSED = re.compile(r"^(?P<p>.*)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")


class SafetensorsFolder:
    """The tensors of a folder of ``*.safetensors`` files, read by region."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {name: self.folder / file for name, file in weight_map.items()}
        else:
            self.where = {}
            for file in sorted(self.folder.glob("*.safetensors")):
                for name in self._open(file).keys():
                    self.where[name] = file
        self.bytes_read = 0

    def _open(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
        return self._handles[file]

    def close(self) -> None:
        self._stack.close()

    def read(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region ``[offset, offset + shape)`` of tensor ``name``, however it is stored."""
        if name in self.where:
            return self._slice(name, offset, shape)
        fused = FUSED.match(name)
        if fused:
            return self._read_legacy_experts(name, fused["p"], fused["kind"], offset, shape)
        for pattern, legacy in LEGACY_RENAMES:
            old = pattern.sub(legacy, name)
            if old != name and old in self.where:
                return self._slice(old, offset, shape)
        raise KeyError(f"{name} is not in the checkpoint {self.folder}, under its own or a legacy name")

    def mismatches(self, expected: dict[str, tuple[int, ...]]) -> list[str]:
        """Each tensor of ``expected`` (name -> the full shape the model's config gives it) that the
        checkpoint lacks or holds with another shape, as "name in file: expected [..], found [..]";
        for per-expert checkpoints, also experts beyond the config's count. Headers only."""
        found = []
        for name, shape in expected.items():
            fused = FUSED.match(name)
            if name in self.where:
                found += self._compare(name, name, shape)
            elif fused:
                found += self._legacy_mismatches(name, fused["p"], fused["kind"], shape)
            else:
                old = next((o for pattern, legacy in LEGACY_RENAMES if (o := pattern.sub(legacy, name)) != name
                            and o in self.where), None)
                found += [f"{name}: missing"] if old is None else self._compare(name, old, shape)
        return found

    def _compare(self, name: str, stored: str, shape: tuple[int, ...]) -> list[str]:
        full = tuple(self._open(self.where[stored]).get_slice(stored).get_shape())
        if full == tuple(shape):
            return []
        label = name if stored == name else f"{name} (stored as {stored})"
        return [f"{label} in {self.where[stored].name}: expected {list(shape)}, found {list(full)}"]

    def _legacy_mismatches(self, name: str, prefix: str, kind: str, shape: tuple[int, ...]) -> list[str]:
        layout = next(((g, u, d) for g, u, d in LEGACY_EXPERTS if g.format(p=prefix, e=0) in self.where), None)
        if layout is None:
            return [f"{name}: missing, neither fused nor per expert"]
        gate, up, down = layout
        num_experts, rows, cols = shape
        # gate_up [E, 2I, H] is each expert's gate [I, H] over its up [I, H]; down [E, H, I] is w2.
        per_expert = [(down, (rows, cols))] if kind == "down_proj" else [(gate, (rows // 2, cols)), (up, (rows // 2, cols))]
        found = []
        for e in range(num_experts):
            for pattern, part_shape in per_expert:
                part = pattern.format(p=prefix, e=e)
                found += [f"{part}: missing"] if part not in self.where else self._compare(part, part, part_shape)
        extra = per_expert[0][0].format(p=prefix, e=num_experts)
        if extra in self.where:
            found.append(f"{extra} in {self.where[extra].name}: the checkpoint holds more than the config's "
                         f"{num_experts} experts")
        return found

    def _slice(self, name: str, offset, shape) -> torch.Tensor:
        view = self._open(self.where[name]).get_slice(name)
        full = view.get_shape()
        if len(full) != len(shape) or any(o + s > f for o, s, f in zip(offset, shape, full)):
            raise ValueError(f"{name}: region offset={offset} shape={shape} lies outside its shape {full}")
        region = view[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        self.bytes_read += region.numel() * region.element_size()
        return region

    def _read_legacy_experts(self, name, prefix, kind, offset, shape) -> torch.Tensor:
        for gate, up, down in LEGACY_EXPERTS:
            if gate.format(p=prefix, e=offset[0]) in self.where:
                break
        else:
            raise KeyError(f"{name} is not in the checkpoint {self.folder}, neither fused nor per expert")
        e0, r0, c0 = offset
        ne, nr, nc = shape
        experts = []
        for e in range(e0, e0 + ne):
            if kind == "down_proj":
                experts.append(self._slice(down.format(p=prefix, e=e), (r0, c0), (nr, nc)))
                continue
            # gate_up rows [0, I) come from the gate matrix, [I, 2I) from the up matrix.
            inter = self._open(self.where[gate.format(p=prefix, e=e)]).get_slice(gate.format(p=prefix, e=e)).get_shape()[0]
            parts = []
            lo, hi = r0, r0 + nr
            if lo < inter:
                parts.append(self._slice(gate.format(p=prefix, e=e), (lo, c0), (min(hi, inter) - lo, nc)))
            if hi > inter:
                start = max(lo, inter) - inter
                parts.append(self._slice(up.format(p=prefix, e=e), (start, c0), (hi - inter - start, nc)))
            experts.append(torch.cat(parts, 0))
        return torch.stack(experts) if experts else torch.empty(shape)


def _non_persistent_buffers(model: torch.nn.Module) -> set[str]:
    return {f"{m}.{b}" if m else b for m, module in model.named_modules() for b in module._non_persistent_buffers_set}


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, folder: Path, device: torch.device, *,
                    part: torch.nn.Module | None = None) -> dict[str, int]:
    """Allocate the local shards of a meta (possibly sharded) model on ``device`` and fill them from
    ``folder``, with no random initialisation first: every parameter and persistent buffer is read
    from the checkpoint, and only the non-persistent buffers (rotary tables), which checkpoints do
    not hold, are computed by the model's own init. ``part``: what this rank holds under the
    model's names (its pipeline stages), default the whole model. Returns the bytes read from the
    safetensors files per tensor name (this rank's slices only)."""
    part = model if part is None else part
    reader = SafetensorsFolder(folder)
    try:
        _check_against_config(reader, model, folder)
        part.to_empty(device=device)
        for module in part.modules():
            if module._non_persistent_buffers_set:
                # Before the reads: it would also re-draw the module's own parameters, if it had any.
                model._init_weights(module)
        non_persistent = _non_persistent_buffers(part)
        read = {}
        for name, tensor in [*part.named_parameters(), *((n, b) for n, b in part.named_buffers() if n not in non_persistent)]:
            local, offset = local_chunk(tensor)
            if local.numel() == 0:
                continue
            before = reader.bytes_read
            local.copy_(reader.read(name, offset, tuple(local.shape)))
            read[name] = reader.bytes_read - before
    finally:
        reader.close()
    return read


def _check_against_config(reader: SafetensorsFolder, model: torch.nn.Module, folder: Path) -> None:
    """Before any allocation or read, every tensor of the whole model (the same verdict on every
    rank, whichever stages it holds) at the full shape its config gives it: transformers refuses
    such folders, and reading a slice of a larger tensor would train another model silently."""
    skip = _non_persistent_buffers(model)
    expected = {n: tuple(t.shape) for n, t in (*model.named_parameters(), *model.named_buffers()) if n not in skip}
    mismatched = reader.mismatches(expected)
    if mismatched:
        shown = "; ".join(mismatched[:6]) + (f"; and {len(mismatched) - 6} more" if len(mismatched) > 6 else "")
        raise UsageError(f"--model: the weights in {folder} do not match its config.json ({len(mismatched)} "
                         f"tensors): {shown}", agreed=True)
