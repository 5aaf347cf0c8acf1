"""Convert a training checkpoint into a Hugging Face folder that plain transformers loads.

    python examples/mixtral/export.py --checkpoint runs/mixtral-tiny/checkpoints/step_00000200 --out hf-model

The checkpoint's DCP shards hold Hugging Face parameter names with global shapes, so conversion is a
single-process load into a model built from the checkpoint's config.json, then ``save_pretrained``.
The written config names no moe_ep implementation: the folder needs nothing but transformers.

The checkpoint is verified against its manifest first (every file's size and checksum). The output
goes to a new folder, an empty one, or one a previous export made (it carries the export's
marker, moe_ep.runs' ownership.py); never to the checkpoint, the run folder that holds it, a folder around or
inside them, or any other folder with files in it. The folder is never seen partly written: it is
written under ``.tmp-NAME`` (marked first), an earlier export of the same name is renamed aside to
``.trash-NAME``, the new one renamed into place, and only then the old one deleted (a kill between
the two renames leaves neither under the name, and the two marked folders beside it, which the
next export removes)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError

from moe_ep.runs import (
    TRASH_PREFIX,
    RunError,
    UsageError,
    check_export_target,
    damage_report,
    export_files,
    export_lock,
    is_complete,
    local_problems,
    manifest_must_list,
    mark,
    quiet_single_process,
    write_failure,
)

CONFIG = "config.json"


def protected_folders(checkpoint: Path) -> dict[str, Path]:
    """What an export of ``checkpoint`` must stay out of: the checkpoint, and the run folder when it
    sits in one (``RUN/checkpoints/step_N``, as train.py writes them)."""
    protected = {"the checkpoint": checkpoint}
    if checkpoint.parent.name == "checkpoints":
        protected["the run folder"] = checkpoint.parent.parent
    return protected


def check_checkpoint(checkpoint: Path) -> None:
    if not is_complete(checkpoint) or not (checkpoint / CONFIG).is_file():
        raise UsageError(f"--checkpoint: {checkpoint} is not a complete checkpoint with a {CONFIG}")
    problems = local_problems(checkpoint, must_list=manifest_must_list(checkpoint))
    if problems:
        raise UsageError(f"--checkpoint: {damage_report(checkpoint, problems)}")


def load_config(checkpoint: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError) as err:
        raise UsageError(f"--checkpoint: {checkpoint / CONFIG} cannot be read as a model config "
                         f"({str(err).splitlines()[0]})") from None


def export_hf(checkpoint: Path, out_dir: Path, *, dtype: torch.dtype | None = None) -> Path:
    checkpoint, out_dir = Path(checkpoint), Path(out_dir).resolve()  # "." has no name to put .tmp- before
    check_export_target(out_dir, protected_folders(checkpoint), "--out")
    check_checkpoint(checkpoint)
    with export_lock(out_dir, "--out"):
        return _export_locked(checkpoint, out_dir, dtype)


def _export_locked(checkpoint: Path, out_dir: Path, dtype: torch.dtype | None) -> Path:
    """export_hf's work, under the export's lock."""
    from transformers import AutoModelForCausalLM

    config = load_config(checkpoint)
    # Built directly in the output dtype: DCP converts while it reads, so a bf16 export of a
    # 47B model needs ~94 GB of host memory, not the ~188 GB of an fp32 copy.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    # Every shard read into this one process, with no collective: also where a process group
    # exists (a training script converting on its rank 0 while its peers go on), which DCP's
    # load would otherwise enter and wait in for ranks that never join.
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    # Saved checkpoints name transformers' default kernels; users pick moe_ep again when loading.
    model.config._experts_implementation = None
    tmp, trash = out_dir.with_name(f".tmp-{out_dir.name}"), out_dir.with_name(f"{TRASH_PREFIX}{out_dir.name}")
    try:
        for leftover in (tmp, trash):  # an earlier interrupted export's (check_export_target: ours)
            if leftover.exists():
                shutil.rmtree(leftover)
        tmp.mkdir(parents=True)
        mark(tmp, "export", checkpoint=str(checkpoint.resolve()))
        model.save_pretrained(tmp)
        # What it wrote, so that a later export replaces nothing else (files a user adds to it).
        mark(tmp, "export", checkpoint=str(checkpoint.resolve()), files=export_files(tmp))
        if out_dir.exists():
            os.rename(out_dir, trash)
        os.rename(tmp, out_dir)
        if trash.exists():
            shutil.rmtree(trash)
    except (OSError, SafetensorError) as err:  # safetensors says a full disk as its own error
        raise RunError(write_failure(getattr(err, "filename", None) or tmp, err)) from None
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoints/step_XXXXXXXX folder")
    p.add_argument("--out", required=True,
                   help="the Hugging Face folder to write: new, empty, or an earlier export (which is replaced)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast the weights (default: keep the training dtype, float32)")
    args = p.parse_args(argv)
    try:
        out = export_hf(Path(args.checkpoint), Path(args.out), dtype=getattr(torch, args.dtype) if args.dtype else None)
    except (UsageError, RunError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
