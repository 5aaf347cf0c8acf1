"""Sharded checkpoints (torch.distributed.checkpoint) that a killed run can always resume from, and
whose damage is found before anything is loaded.

A checkpoint is written into ``checkpoints/.tmp-step_XXXXXXXX`` by every rank: DCP's shards and
metadata, each rank's RNG state, then the trainer state and config, and last a manifest of every
file with its size and SHA-256 (the ranks share the hashing), written atomically. Only then does
rank 0 rename the folder to ``checkpoints/step_XXXXXXXX``. A rename within one folder is atomic,
so a folder with the final name is always complete, and a run killed mid-write leaves only a
``.tmp-`` folder, which is never read and is removed by the next run. Deletion is the same in
reverse: a checkpoint that is replaced or pruned is first renamed to ``.trash-step_XXXXXXXX``,
then deleted, so a run killed mid-delete never leaves a partly deleted folder under a final name.
Older checkpoints are pruned only once the new one is complete, its manifest made from the files
read back; weights or optimizer state that are not finite are never written.

Rolling back is a branch: a run resumed from a checkpoint older than the newest sets the later ones
aside, whole, in ``checkpoints/abandoned-<time>-from-step-<N>/`` (set_aside_later_checkpoints; never
deleted, never listed as a checkpoint, so ``--resume auto`` never continues the abandoned branch and
a new checkpoint of the same step replaces nothing of it). The step it branched from is kept in the
trainer state's ``branch_points``, which pruning never counts nor deletes. The output folder
must be shared by all nodes; ``checkpoints/`` carries the run's marker (ownership.py), and nothing
outside a folder so marked is ever deleted.

Resuming checks a checkpoint in two steps: before start-up every rank reads its manifest, the
files' sizes and the checksums of the small files (quick_problems); after start-up the ranks
verify the shards' checksums together and agree on the verdict (integrity.verify).

Test hooks (environment variables):
``MOE_EP_TEST_PAUSE_IN_CHECKPOINT=N``: every rank stops inside the save of step N once its
shards and RNG state are in the ``.tmp-`` folder, touches ``paused-rankR`` there and waits until
that file is deleted, so that a test can kill the run mid-write, or let it go on, deterministically.
``MOE_EP_TEST_DISK_FULL=N:R``: in the save of step N, rank R's DCP shard file is a link to
``/dev/full``, so its write fails as on a full disk (ENOSPC from the kernel).
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..training.optim import AdamW as BF16MomentsAdamW
from ..training.optim import check_hyperparameters
from .errors import RunError, UsageError, failure_cause, write_failure
from .integrity import MANIFEST, files_in, gather, local_problems, read_manifest, seal, verify
from .ownership import (
    TMP_PREFIX,
    TRASH_PREFIX,
    delete_atomically,
    fsync_dir,
    make_managed_dir,
    mark,
    marker_info,
    ours,
    refuse_link,
)

STEP_DIR = re.compile(r"^step_(\d{8})$")
ABANDONED_PREFIX = "abandoned-"
TRAINER_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"
SHARD_SUFFIX = ".distcp"
PAUSE_HOOK = "MOE_EP_TEST_PAUSE_IN_CHECKPOINT"  # see the module's docstring
DISK_FULL_HOOK = "MOE_EP_TEST_DISK_FULL"
# Optimizer state and hyper-parameters keyed by parameter name (state.<fqn>.exp_avg,
# param_groups.<fqn>.lr), not by position in the param groups: the ranks of different pipeline
# stages hold different groups, and a checkpoint then loads under any other layout.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@contextmanager
def quiet_single_process():
    """DCP warns that it assumes a single process when no process group exists; that is the intent
    here (one-process runs and the export), so the warning is dropped, and only that one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name)[1])


def is_complete(path: Path) -> bool:
    """Named as a checkpoint and holding the manifest that is written last."""
    return STEP_DIR.match(path.name) is not None and (path / MANIFEST).is_file()


def step_folders(root: Path) -> list[Path]:
    """Folders named as checkpoints under ``root``, complete or not, oldest first; ``.tmp-`` and
    ``.trash-`` folders never count."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=step_of)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    return [p for p in step_folders(root) if is_complete(p)]


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def manifest_must_list(path: Path) -> set[str]:
    """What the manifest of the checkpoint ``path`` must list: every file in the folder (the save
    lists all it wrote, and a load may read any of them) and, present or not, those every load
    reads."""
    try:
        present = set(files_in(path))
    except OSError:
        present = set()
    return present | {DCP_METADATA, TRAINER_STATE}


def quick_problems(path: Path) -> list[str]:
    """What each rank can check alone before start-up: the manifest, every file's size, and the
    checksums of all files but the (large) DCP shards."""
    return local_problems(path, hash_if=lambda name: not name.endswith(SHARD_SUFFIX), must_list=manifest_must_list(path))


def remove_incomplete(root: Path) -> list[Path]:
    """Delete the leftovers of interrupted writes and deletions (rank 0 only), in a checkpoints
    folder that is the run's own, never through a link. Returns what it removed."""
    if not root.is_dir() or not ours(root, "checkpoints"):
        return []
    stale = sorted(p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)))
    for path in stale:
        refuse_link(path)
        shutil.rmtree(path)
    return stale


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def write_file(path: Path, data: bytes) -> None:
    """Write and flush to disk; an error names the file and its cause (a full disk included)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise RunError(write_failure(path, err)) from None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def first_non_finite(model, optimizer) -> str | None:
    """The first parameter or optimizer state of this rank holding a NaN or an infinity, or None."""
    names = {id(p): n for n, p in model.named_parameters()}
    named = [(n, local_tensor(p)) for n, p in model.named_parameters()]
    for p, state in optimizer.state.items():
        named += [(f"{key} of {names.get(id(p), '?')}", local_tensor(v)) for key, v in state.items()
                  if torch.is_tensor(v) and v.is_floating_point()]
    named = [(n, t) for n, t in named if t.numel()]
    if not named:
        return None
    # host sync: once per checkpoint.
    bad = torch.stack([~torch.isfinite(t).all() for _, t in named]).cpu().tolist()
    return next((n for (n, _), b in zip(named, bad) if b), None)


def dcp_failure(action: str, folder: Path, err: CheckpointException, *, writing: bool) -> str:
    """One line for DCP's error, which carries every failing rank's exception (while ``writing``, a
    full disk said as one, failure_cause)."""
    causes = []
    for rank, (exc, _trace) in sorted(err.failures.items()):
        cause = failure_cause(folder, exc) if writing else (
            getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0])
        causes.append(f"rank {rank}: {cause}")
    return f"cannot {action} {folder}: {'; '.join(causes)}"


def disk_full_hook(tmp: Path, step: int, rank: int) -> None:
    if os.environ.get(DISK_FULL_HOOK) == f"{step}:{rank}":
        # DCP names a rank's first shard __<rank>_0.distcp; a write through this link gets ENOSPC.
        os.symlink("/dev/full", tmp / f"__{rank}_0{SHARD_SUFFIX}")


def pause_hook(tmp: Path, step: int, rank: int) -> None:
    if os.environ.get(PAUSE_HOOK) == str(step):
        paused = tmp / f"paused-rank{rank:05d}"
        paused.touch()
        deadline = time.monotonic() + 3600
        while paused.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def save_checkpoint(root: Path, step: int, model, optimizer, trainer_state: dict, *, rank: int, barrier,
                    keep: int, config=None) -> Path:
    """Collective: every rank calls it with what it trains (the model, or its pipeline stages
    under the model's names, layout.rank_view). Returns the final folder. Raises RunError, on every
    rank where the failure is known to all (``agreed``), with nothing of the previous checkpoints
    touched. ``keep``: the newest checkpoints kept, this one included; the steps listed in
    ``trainer_state["branch_points"]`` (where a rolled-back run resumed) are kept besides them."""
    final, tmp = step_dir(root, step), root / f"{TMP_PREFIX}step_{step:08d}"
    previous = latest_checkpoint(root)
    kept = f"{previous} is intact" if previous is not None else "no earlier checkpoint exists"
    bad = [f"{name} on rank {r}" for r, name in enumerate(gather(first_non_finite(model, optimizer))) if name]
    if bad:
        raise RunError(f"step {step}: the weights hold NaN or infinite values ({bad[0]}); not checkpointed, "
                       f"{kept}", agreed=True)
    if rank == 0:
        make_managed_dir(root, "checkpoints")
        try:
            refuse_link(tmp)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as err:
            raise RunError(f"{write_failure(tmp, err)}; {kept}") from None
    barrier()
    disk_full_hook(tmp, step, rank)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    try:
        with quiet_single_process():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    except CheckpointException as err:
        raise RunError(f"{dcp_failure('write the checkpoint', tmp, err, writing=True)}; {kept}", agreed=True) from None
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    write_file(rng_file(tmp, rank), buffer.getvalue())
    pause_hook(tmp, step, rank)
    barrier()
    if rank == 0:
        write_file(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1).encode())
        if config is not None:
            try:
                config.save_pretrained(tmp)
            except OSError as err:
                raise RunError(f"{write_failure(tmp / 'config.json', err)}; {kept}") from None
    barrier()
    try:
        unreadable = seal(tmp, step=step)
    except OSError as err:  # rank 0's manifest
        raise RunError(f"{write_failure(tmp / MANIFEST, err)}; {kept}") from None
    if unreadable:
        raise RunError(f"cannot read back {tmp}: {', '.join(unreadable)}; {kept}", agreed=True)
    if rank == 0:
        trash = None
        if final.exists():
            # A checkpoint of this step exists (a resumed run re-saving it): moved aside whole,
            # and deleted only once the new one holds the name.
            trash = root / f"{TRASH_PREFIX}{final.name}"
            refuse_link(trash)
            if trash.exists():
                shutil.rmtree(trash)
            os.rename(final, trash)
        os.rename(tmp, final)
        fsync_dir(root)
        if trash is not None:
            shutil.rmtree(trash)
        # The new checkpoint is complete: only now may older ones go, never the new one nor a
        # branch point.
        branch_points = set(trainer_state.get("branch_points", ()))
        others = [p for p in complete_checkpoints(root) if p != final and step_of(p) not in branch_points]
        for old in others[:max(0, len(others) - (keep - 1))]:
            delete_atomically(old)
    barrier()
    return final


def read_trainer_state(path: Path) -> dict:
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--resume: {path / TRAINER_STATE} is unreadable ({err}); the checkpoint is damaged") from None
    if not isinstance(state, dict) or not {"step", "world_size", "data"} <= set(state):
        raise UsageError(f"--resume: {path / TRAINER_STATE} is not a moe_ep trainer state")
    return state


def rng_file(path: Path, rank: int) -> Path:
    return path / f"rng-rank{rank:05d}.pt"


def load_checkpoint(path: Path, model, optimizer, *, rank: int, world_size: int, verified: bool = False) -> dict:
    """Collective: load model and optimizer shards (DCP reshards if the layout changed) and, at the
    world size that saved it, this rank's RNG state (what makes a resumed run bit-identical; at
    another world size the ranks' streams have no counterpart). Returns the trainer state.

    The checkpoint is verified against its manifest first (every file's size and SHA-256, the ranks
    sharing the hashing and agreeing on the verdict): a damaged one (a flipped byte, a file cut,
    missing or not in the manifest) raises RunError on every rank, naming the file, with nothing
    loaded; DCP itself checks no content. ``verified=True`` skips that where the caller verified
    it already (verified_resume)."""
    path = Path(path)
    if not verified:
        problems = verify(path, must_list=manifest_must_list(path))
        if problems:
            raise RunError(f"{damage_report(path, problems)}; nothing was loaded", agreed=True)
    trainer_state = read_trainer_state(path)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    kept, extra = _group_options_across(path, optim_sd)
    for key in kept:
        del optim_sd[key]
    optim_sd.update(dict.fromkeys(extra))  # placeholders: DCP fills in the saved objects
    state = {"model": model_sd, "optim": optim_sd}
    try:
        with quiet_single_process():
            dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as err:
        raise RunError(dcp_failure("load the checkpoint", path, err, writing=False), agreed=True) from None
    saved_options = {key: state["optim"].pop(key) for key in extra}
    _check_saved_group_options(path, optimizer, state["optim"], saved_options)
    state["optim"].update(kept)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=STATE_DICT_OPTIONS)
    if trainer_state["world_size"] == world_size:
        set_rng_state(torch.load(rng_file(path, rank), weights_only=False))
    return trainer_state


# The options torch.optim.AdamW's (and Adam's) parameter groups carry beside lr, betas, eps and
# weight_decay, each with the value that means what an optimizer without the option does.
# moe_ep.AdamW's groups hold none of them, so the DCP keys of its checkpoints and of torch's
# differ by these: each side's load asked for keys the other never wrote ("Missing key in
# checkpoint state_dict: optim.param_groups.<name>.amsgrad") or left out options it cannot apply.
TORCH_GROUP_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                        "differentiable": False, "fused": None, "decoupled_weight_decay": True}
_GROUPS = "param_groups."


def _group_options_across(path: Path, optim_sd: dict) -> tuple[dict, list[str]]:
    """Between the optimizer's flattened state dict and the checkpoint ``path``: the optimizer's
    group options of TORCH_GROUP_DEFAULTS that the checkpoint lacks while the optimizer holds their
    default (kept as they are: the saving optimizer had no such option, which is that default), and
    the checkpoint's group options of TORCH_GROUP_DEFAULTS for this optimizer's parameters that the
    optimizer has no such option for (loaded to be checked: a value it cannot apply is refused)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 (a damaged .metadata: dcp.load below says it as a RunError)
        return {}, []
    saved = {key[len("optim."):] for key in metadata if key.startswith(f"optim.{_GROUPS}")}
    option = lambda key: key.rsplit(".", 1)[1]  # noqa: E731
    requested = [key for key in optim_sd if key.startswith(_GROUPS)]
    kept = {key: optim_sd[key] for key in requested if key not in saved and option(key) in TORCH_GROUP_DEFAULTS
            and optim_sd[key] == TORCH_GROUP_DEFAULTS[option(key)]}
    names = {key.rsplit(".", 1)[0] for key in requested}
    extra = sorted(key for key in saved - set(optim_sd)
                   if option(key) in TORCH_GROUP_DEFAULTS and key.rsplit(".", 1)[0] in names)
    return kept, extra


def _check_saved_group_options(path: Path, optimizer, optim_sd: dict, saved_options: dict) -> None:
    """Refuse options the checkpoint's groups set that ``optimizer`` has none of and cannot apply:
    moe_ep's AdamW checks them as its load_state_dict does (amsgrad, maximize, fused, ...);
    another optimizer refuses a saved amsgrad, maximize or decoupled_weight_decay other than the
    default it implies by not having the option."""
    by_group: dict[str, dict] = {}
    for key, value in saved_options.items():
        name, option = key[len(_GROUPS):].rsplit(".", 1)
        by_group.setdefault(name, {})[option] = value
    for name, options in sorted(by_group.items()):
        where = f" of {name}'s parameter group in the checkpoint {path}"
        if isinstance(optimizer, BF16MomentsAdamW):
            group = {key.rsplit(".", 1)[1]: value for key, value in optim_sd.items()
                     if key.startswith(f"{_GROUPS}{name}.") and key.count(".") == name.count(".") + 2}
            try:
                check_hyperparameters({**group, **options}, optimizer.moments_dtype, where)
            except ValueError as err:
                raise UsageError(str(err), agreed=True) from None
            continue
        differ = [f"{option}={value!r}" for option, value in sorted(options.items())
                  if option in ("amsgrad", "maximize", "decoupled_weight_decay")
                  and value != TORCH_GROUP_DEFAULTS[option]]
        if differ:
            raise UsageError(f"{type(optimizer).__name__} has no option {', '.join(differ)}{where}; load it into the "
                             "optimizer that saved it", agreed=True)


def damage_report(path: Path, problems: list[str]) -> str:
    return f"the checkpoint {path} is damaged: {'; '.join(problems)}"


def resume_candidates(resume: str, root: Path) -> tuple[list[Path], list[str]]:
    """Before start-up (each rank alone, quick_problems): the checkpoints to try, newest first,
    and a warning for each one skipped. ``resume``: ``auto`` (every checkpoint of ``root``; the
    damaged ones are skipped, but not all of them) or a checkpoint folder, which must be intact."""
    if resume != "auto":
        folder = Path(resume)
        written = [name for name in (MANIFEST, TRAINER_STATE, ".metadata") if (folder / name).exists()]
        if folder.is_dir() and not written and not any(p.suffix == SHARD_SUFFIX for p in folder.iterdir()):
            # Not one file a save writes: not a damaged checkpoint but some other folder.
            raise UsageError(f"--resume: {folder} is not a checkpoint of moe_ep.runs (it holds no {MANIFEST}, "
                             f"{TRAINER_STATE} or {SHARD_SUFFIX} shard); give a step_* folder of a run's checkpoints/, "
                             "or auto")
        listed, _ = read_manifest(folder)
        if listed is not None and TRAINER_STATE not in listed and not (folder / TRAINER_STATE).exists():
            # A whole manifest of a folder with no trainer state: sealed by another writer
            # (moe_ep.runs.RunFolder under an accelerate or Trainer loop), not damaged.
            raise UsageError(f"--resume: {folder} is a checkpoint of another kind (its {MANIFEST} lists no "
                             f"{TRAINER_STATE}: an accelerate or Trainer loop's?); give a step_* folder of this "
                             "script's checkpoints/, or auto")
        problems = quick_problems(folder)
        if problems:
            raise UsageError(f"--resume: {damage_report(Path(resume), problems)}; resume another checkpoint "
                             "(--resume PATH, or auto for the newest intact one)")
        return [Path(resume)], []
    good, skipped = [], []
    for path in reversed(step_folders(root)):
        problems = quick_problems(path)
        if problems:
            skipped.append(damage_report(path, problems))
        else:
            good.append(path)
    if skipped and not good:
        raise UsageError(f"--resume auto: every checkpoint in {root} is damaged ({'; '.join(skipped)}); start afresh "
                         "with --overwrite (which deletes them) or choose another --output-dir")
    return good, [f"--resume auto: skipping {s}" for s in skipped]


def verified_resume(candidates: list[Path], *, explicit: bool, warn, must_list=manifest_must_list) -> Path | None:
    """Collective: the first of ``candidates`` whose every file matches its checksum, the ranks
    sharing the hashing and agreeing on the verdict; a damaged one is skipped with a warning,
    unless it was named by ``--resume PATH`` (``explicit``), which stops every rank.
    ``must_list(path)``: the files its manifest must list (read_manifest)."""
    for path in candidates:
        problems = verify(path, must_list=must_list(path))
        if not problems:
            return path
        if explicit:
            raise UsageError(f"--resume: {damage_report(path, problems)}; resume another checkpoint", agreed=True)
        warn(f"--resume auto: skipping {damage_report(path, problems)}")
    if candidates:
        raise UsageError(f"--resume auto: every checkpoint in {candidates[0].parent} is damaged; start afresh with "
                         "--overwrite (which deletes them) or choose another --output-dir", agreed=True)
    return None


def resume_target(resume: str, root: Path, *, overwrite: bool) -> tuple[list[Path], list[str]]:
    """Before start-up: the checkpoints to try resuming, newest first, and warnings for those
    skipped (resume_candidates); none to start afresh. ``resume``: ``auto``, ``never`` (refused
    where checkpoints exist, which a new run would write over) or a checkpoint folder;
    ``overwrite``: the run starts afresh, its checkpoints deleted."""
    if overwrite:
        return [], []
    if resume == "never":
        found = step_folders(root)
        if found:
            raise UsageError(f"--resume never, but {root} holds checkpoints up to {found[-1].name}; pass --overwrite to "
                             "delete them, or choose another --output-dir")
        return [], []
    return resume_candidates(resume, root)


# The fields of a transformers config that make the network: a checkpoint of a model that differs
# in one of them is another model's, even where its tensors have the same shapes (top-k, routing
# groups, the window, the rotary base) or where the model reads only some of them (fewer layers).
ARCHITECTURE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "shared_expert_intermediate_size", "first_k_dense_replace",
    "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "hidden_act",
    "tie_word_embeddings", "sliding_window", "layer_types", "rope_parameters", "rms_norm_eps", "attention_bias",
    "qkv_bias", "clip_qkv",
)


def check_resume_data(resume: Path, identity: dict, config=None) -> None:
    """Refuse to continue a checkpoint on other data: ``identity`` (what a resumed run must share
    with the saved one: the token stream, the packing, the global batch, the seed) against the
    trainer state's ``data``; entries that are None are not known yet and are compared once they
    are. With ``config`` (the model's transformers config), refuse a checkpoint whose
    ``config.json`` differs from it in an ``ARCHITECTURE_FIELDS`` field."""
    if config is not None:
        refuse_other_model(resume, config)
    refuse_other_data(resume, read_trainer_state(resume)["data"], identity)


def refuse_other_model(resume: Path, config) -> None:
    """A checkpoint saved without its ``config.json`` has nothing to compare and passes."""
    try:
        saved = json.loads((resume / "config.json").read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as err:
        raise UsageError(f"--resume {resume}: its config.json cannot be read ({err})") from None
    current = json.loads(config.to_json_string(use_diff=False))
    differ = [f"{key}: {saved.get(key)!r} then, {current.get(key)!r} now" for key in ARCHITECTURE_FIELDS
              if saved.get(key) != current.get(key)]
    if differ:
        raise UsageError(
            f"--resume {resume}: the checkpoint is of another model ({'; '.join(differ)}); resuming would load "
            "its weights into this one: pass the --model it was trained with, or --overwrite to start afresh"
        )


def refuse_other_data(resume: Path, saved: dict | None, identity: dict) -> None:
    """``check_resume_data`` against ``saved``, the data identity the checkpoint ``resume`` was
    saved with (None: it records none, so nothing vouches for it). A field the saved identity
    lacks (a checkpoint written before the field existed) is not compared."""
    # Without a saved identity every known field differs; with one, those it records.
    differ = [f"{key}: {(saved or {}).get(key)!r} then, {value!r} now" for key, value in identity.items()
              if value is not None and (not saved or key in saved) and (saved or {}).get(key) != value]
    if differ:
        raise UsageError(
            f"--resume {resume}: the checkpoint was trained on other data or another global batch "
            f"({'; '.join(differ)}); resuming would not continue that run: pass --overwrite to start afresh, "
            "or choose another --output-dir"
        )


def checkpoint_due(step: int, *, every: int, last: int) -> bool:
    """Whether optimizer step ``step`` (1-based) ends with a checkpoint: every ``every`` steps (0:
    none) and at the schedule's ``last`` step."""
    return step == last or (every > 0 and step % every == 0)


def branch_step(root: Path, resumed: Path | None, step: int) -> int:
    """The step after which the run that wrote ``resumed`` (of optimizer step ``step``; None, step
    0: a start afresh) and the checkpoints of ``root`` part: ``step`` itself, but for a
    checkpoint of a branch set aside earlier and taken up again by its path (a step folder of
    ``root/abandoned-*/``), the step that branch left ``root`` at, which the folder's marker
    records: ``root``'s checkpoint of that step is the two branches' last common one, its later
    ones the other branch's."""
    if resumed is None:
        return step
    aside = resumed.resolve().parent
    if aside.parent != root.resolve() or _set_aside_order(aside) is None:
        return step
    # Each rollback after this branch was set aside cut the live line back further: it shares
    # with this branch only what it kept through all of them.
    branches = [p for p in root.resolve().iterdir()
                if (order := _set_aside_order(p)) is not None and order >= _set_aside_order(aside)]
    lefts = [marker_info(p).get("from_step") for p in branches if marker_info(p).get("kind") == "abandoned"]
    lefts = [left for left in lefts if isinstance(left, int) and not isinstance(left, bool) and 0 <= left < step]
    return min(lefts, default=step)


_ABANDONED_NAME = re.compile(rf"^{ABANDONED_PREFIX}(\d{{8}}-\d{{6}})-from-step-\d+(?:\.\d+)?$")


def _set_aside_order(folder: Path) -> int | None:
    """When an abandoned branch's folder was set aside, in ns (its marker's; by a run before
    that was recorded, the second its name gives); None for another folder."""
    match = _ABANDONED_NAME.match(folder.name)
    if match is None or not folder.is_dir():
        return None
    recorded = marker_info(folder).get("set_aside_ns")
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    return int(time.mktime(time.strptime(match[1], "%Y%m%d-%H%M%S"))) * 10**9


def set_aside_later_checkpoints(root: Path, step: int, resumed: Path | None, *, rank: int,
                                folders: list[Path] | None = None, step_of=step_of) -> Path | None:
    """Collective, once the checkpoint ``resumed`` of optimizer step ``step`` is chosen (None, step
    0: a start afresh): rank 0 moves every checkpoint folder of ``root`` of step ``step`` or later
    but ``resumed`` itself (complete or damaged; ``folders`` and ``step_of``: the checkpoint
    folders and their steps where ``root`` is not laid out as this module writes it), whole, into
    a new marked folder ``root/abandoned-<time>-from-step-<step>/``, which every rank gets back
    (None where nothing is moved): the abandoned branch stays on disk for the user, out of reach of
    ``--resume auto``, of pruning and of the resumed run's checkpoints of the same steps. A
    branch set aside earlier and taken up again by its path moves, instead, every checkpoint of
    ``root`` after the step it left ``root`` at (``branch_step``): the other branch's, which
    pruning would otherwise take for this run's older ones. A failure to move raises RunError on
    every rank, nothing deleted."""
    outcome = None
    if rank == 0:
        first = branch_step(root, resumed, step)
        folders = step_folders(root) if folders is None else folders
        later = [p for p in folders if step_of(p) > first or (first == step and step_of(p) == step)]
        try:
            kept = None if resumed is None else resumed.resolve()
            outcome = str(_set_aside(root, first, [p for p in later if p.resolve() != kept]) or "")
        except OSError as err:
            outcome = RunError(f"cannot set aside the checkpoints after step {first} in {root}: "
                               f"{err.strerror or err}; nothing was deleted", agreed=True)
    outcome = gather(outcome)[0]
    if isinstance(outcome, RunError):
        raise outcome
    return Path(outcome) if outcome else None


def _set_aside(root: Path, step: int, later: list[Path]) -> Path | None:
    if not later:
        return None
    name = f"{ABANDONED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-from-step-{step}"
    aside, n = root / name, 1
    while aside.exists():
        aside, n = root / f"{name}.{n}", n + 1
    aside.mkdir()
    mark(aside, "abandoned", from_step=step, set_aside_ns=time.time_ns())
    for path in later:
        os.rename(path, aside / path.name)
    fsync_dir(aside)
    fsync_dir(root)
    return aside
