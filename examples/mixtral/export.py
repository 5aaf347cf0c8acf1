"""Convert a training checkpoint into a Hugging Face folder that plain transformers loads.

    python examples/mixtral/export.py --checkpoint runs/mixtral-tiny/checkpoints/step_00000200 --out hf-model

The checkpoint's DCP shards hold Hugging Face parameter names with global shapes, so conversion is a
single-process load into a model built from the checkpoint's config.json, then ``save_pretrained``.
The written config names no moe_ep implementation: the folder needs nothing but transformers. The
folder is never seen partly written: it is written under a temporary name, an existing folder of the
same name is renamed aside, the new one renamed into place, and only then the old one deleted (a
kill between the two renames leaves neither under the name, and ``.tmp-``/``.trash-`` folders beside
it)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from checkpoint import is_complete, quiet_single_process
from errors import UsageError


def export_hf(checkpoint: Path, out_dir: Path, *, dtype: torch.dtype | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not is_complete(checkpoint) or not (checkpoint / "config.json").is_file():
        raise UsageError(f"--checkpoint: {checkpoint} is not a complete checkpoint with a config.json")
    config = AutoConfig.from_pretrained(checkpoint)
    # Built directly in the output dtype: DCP converts while it reads, so a bf16 export of a
    # 47B model needs ~94 GB of host memory, not the ~188 GB of an fp32 copy.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    # Runs without a process group: DCP then reads every shard into this one process.
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(checkpoint))
    # Saved checkpoints name transformers' default kernels; users pick moe_ep again when loading.
    model.config._experts_implementation = None
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    trash = out_dir.with_name(f".trash-{out_dir.name}")
    if trash.exists():  # left by an earlier interrupted export
        shutil.rmtree(trash)
    if out_dir.exists():
        os.rename(out_dir, trash)
    os.rename(tmp, out_dir)
    if trash.exists():
        shutil.rmtree(trash)
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoints/step_XXXXXXXX folder")
    p.add_argument("--out", required=True, help="the Hugging Face folder to write")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast the weights (default: keep the training dtype, float32)")
    args = p.parse_args(argv)
    try:
        out = export_hf(Path(args.checkpoint), Path(args.out), dtype=getattr(torch, args.dtype) if args.dtype else None)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
