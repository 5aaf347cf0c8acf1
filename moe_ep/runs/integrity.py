"""Manifests: the files of a checkpoint (or of the token cache) with their sizes and SHA-256
checksums, written last and atomically, so that damage (a flipped byte, a truncated or missing
file) is found before anything is loaded, and named by file.

Hashing is shared by the ranks (rank ``r`` hashes files ``r, r + world, ...`` of the sorted list)
and the findings are gathered, so that every rank reaches the same verdict: a rank that finds
damage never leaves its peers waiting in a collective.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist

from .ownership import MANIFEST, fsync_dir, unique_tmp

FORMAT = "moe_ep-manifest/1"
CHUNK = 1 << 22


def digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex) of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def gather(obj) -> list:
    """Every rank's ``obj`` on every rank (collective when a process group exists)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    # host sync: once per checkpoint written or verified.
    dist.all_gather_object(out, obj)
    return out


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def shared_digests(folder: Path, names: list[str]) -> dict[str, tuple[int, str] | str]:
    """Collective: ``{name: (size, sha256)}`` of ``names`` in ``folder``, the hashing split over the
    ranks; a file that cannot be read maps to the reason ("is missing", "cannot be read (...)")."""
    rank, world = rank_world()
    mine = {}
    for name in sorted(names)[rank::world]:
        try:
            mine[name] = digest(folder / name)
        except FileNotFoundError:
            mine[name] = "is missing"
        except OSError as err:
            mine[name] = f"cannot be read ({err.strerror or err})"
    merged = {}
    for part in gather(mine):
        merged.update(part)
    return merged


def files_in(folder: Path, manifest: str = MANIFEST) -> list[str]:
    """Every file under ``folder`` (subfolders too: accelerate's sharded states have them), as paths
    relative to it, the manifest and its temporary copy left out."""
    return sorted(rel for p in folder.rglob("*") if p.is_file() and (rel := p.relative_to(folder).as_posix()) != manifest
                  and not (rel.startswith(f".{manifest}.") and rel.endswith(".tmp")))


def seal(folder: Path, **info) -> list[str]:
    """Collective, once every rank has written its files into ``folder``: the files as rank 0 lists
    them, read back and hashed by all ranks, and the manifest written by rank 0 (atomically, the
    folder synced), with ``info`` beside the files. Returns the files that could not be read back,
    the same list on every rank (no manifest is written then). Rank 0 raises the OSError of a
    manifest that cannot be written."""
    rank, _ = rank_world()
    gather(None)  # every rank has finished writing before rank 0 lists the folder
    names = gather(files_in(folder) if rank == 0 else None)[0]
    files = shared_digests(folder, names)
    unreadable = [f"{name} {why}" for name, why in files.items() if isinstance(why, str)]
    if not unreadable and rank == 0:
        write_manifest(folder, files, **info)
        fsync_dir(folder)
    return unreadable


def write_manifest(folder: Path, files: dict[str, tuple[int, str]], *, manifest: str = MANIFEST, **info) -> None:
    """Atomically: a reader sees no manifest or a whole one."""
    body = {"format": FORMAT, **info, "files": {n: {"bytes": s, "sha256": h} for n, (s, h) in sorted(files.items())}}
    # A name of this writer's own: several processes may write one manifest at once (a token
    # cache's, by several jobs); the last rename wins, whole.
    tmp = unique_tmp(folder, f".{manifest}.")
    try:
        with open(tmp, "x") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / manifest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(folder: Path, manifest: str = MANIFEST, *, must_list: Iterable[str] = ()) -> tuple[dict | None, str | None]:
    """(the manifest's files, None) or (None, what is wrong with it). ``must_list``: the files a
    reader will load; one the manifest leaves out would be loaded unchecked, so it is a fault of
    the manifest (edited, or written by something else) even where the file looks fine."""
    path = folder / manifest
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        if body.get("format") != FORMAT or not all({"bytes", "sha256"} <= set(v) for v in files.values()):
            raise ValueError("not a manifest of this format")
    except FileNotFoundError:
        return None, f"{manifest} is missing (its write did not finish)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"{manifest} is unreadable ({err})"
    unlisted = sorted(set(must_list) - set(files))
    if unlisted:
        shown = ", ".join(unlisted[:3]) + (f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else "")
        return None, f"{manifest} does not list {shown}, so nothing vouches for {'it' if len(unlisted) == 1 else 'them'}"
    return files, None


def read_manifest_field(folder: Path, name: str, manifest: str = MANIFEST):
    """A field the manifest carries beside its files (``seal``'s ``info``), None where it has none;
    for a manifest ``read_manifest`` found sound."""
    return json.loads((folder / manifest).read_text()).get(name)


def local_problems(folder: Path, *, manifest: str = MANIFEST, hash_if=lambda name: True,
                   must_list: Iterable[str] = ()) -> list[str]:
    """Everything wrong with ``folder`` against its manifest that this process can see alone (no
    collective): the manifest (listing ``must_list``), every file's size, and the checksums of the
    files ``hash_if`` selects."""
    files, problem = read_manifest(folder, manifest, must_list=must_list)
    if problem:
        return [problem]
    problems = []
    for name, entry in sorted(files.items()):
        path = folder / name
        try:
            size = path.stat().st_size
            if size != entry["bytes"]:
                problems.append(f"{name} has {size:,} bytes, the manifest says {entry['bytes']:,}")
            elif hash_if(name) and digest(path)[1] != entry["sha256"]:
                problems.append(f"{name} does not match its checksum (its contents changed after it was written)")
        except FileNotFoundError:
            problems.append(f"{name} is missing")
        except OSError as err:
            problems.append(f"{name} cannot be read ({err.strerror or err})")
    return problems


def content_problems(folder: Path, files: dict) -> list[str]:
    """Collective: files whose checksum or size differs from the manifest, or that cannot be read."""
    found = shared_digests(folder, list(files))
    problems = []
    for name in sorted(files):
        got = found.get(name, "was not hashed")
        if isinstance(got, str):
            problems.append(f"{name} {got}")
        elif got[0] != files[name]["bytes"]:
            problems.append(f"{name} has {got[0]:,} bytes, the manifest says {files[name]['bytes']:,}")
        elif got[1] != files[name]["sha256"]:
            problems.append(f"{name} does not match its checksum (its contents changed after it was written)")
    return problems


def verify(folder: Path, *, must_list: Iterable[str] = ()) -> list[str]:
    """Collective: everything wrong with ``folder`` against its manifest (empty: intact), every
    file's checksum compared, ``must_list`` as in read_manifest. The verdict is the same on every
    rank: every rank takes part in the same collectives whatever it finds, and a rank whose view of
    the folder differs (a shared file system's caches) does not decide alone."""
    files, problem = read_manifest(folder, must_list=must_list)
    problems = [problem] if problem else content_problems(folder, files)
    if problem:
        shared_digests(folder, [])  # the collective the other ranks enter
    return next((p for p in gather(problems) if p), [])
