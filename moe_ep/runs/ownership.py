"""What a run may write and delete, and the one job that may do it.

Markers: every folder a run creates for itself carries a small file, ``.moe_ep-owner``,
naming what made it (``run``: the output folder; ``checkpoints``, ``tensorboard``, ``token_cache``:
its managed subfolders; ``export``: a Hugging Face folder written by ``export.py``). A folder
without the marker is the user's: it is never deleted, never replaced and never written into,
except that an empty folder is taken over (nothing in it can be lost). ``metrics.jsonl`` is the
run's when the output folder holds the ``run`` marker.

Lock: one job per output folder. Global rank 0 holds an exclusive POSIX lock (``fcntl.lockf``) on
``.moe_ep-lock`` in the output folder for the run's lifetime; the other ranks join its job through
the process group, which forms only once rank 0 holds the lock (a refused rank 0 exits, and the
launcher stops its peers). The kernel releases the lock however the process ends, SIGKILL
included, so a dead job never leaves a stale lock on its own host. Across hosts this relies on the
shared file system's POSIX locks being cluster-wide (NFSv3 with lockd, NFSv4, GPFS, BeeGFS, Lustre
mounted with ``-o flock``); where a host died without releasing it, the lock stays until the file
server recovers the host's locks (NFSv4: its lease time, 90 s by default). Lustre's ``localflock``
makes such locks node-local: there a second job on another node is not stopped. The lock file
holds the holder's host, pid, start time and job id, so that a refused job can say who has the
folder; the holder empties it when it lets go, so a record found when taking the lock belongs to
a job that died holding it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import RunError, UsageError

MARKER = ".moe_ep-owner"
LOCK_FILE = ".moe_ep-lock"
MANAGED = ("checkpoints", "tensorboard", "token_cache")
METRICS = "metrics.jsonl"
# The file that makes a checkpoint (or cache) complete: every file listed with its size and SHA-256
# (integrity.py writes and checks it).
MANIFEST = "manifest.json"
TRASH_PREFIX = ".trash-"
TMP_PREFIX = ".tmp-"
# check_writable's file, there for an instant while a rank checks the folder before the process
# group exists (its peers may be listing the folder then).
WRITE_CHECK_PREFIX = ".moe_ep-write-check-"
# What a run keeps as a file in its output folder.
RUN_FILES = (METRICS, LOCK_FILE, MARKER)


def marker_info(folder: Path) -> dict:
    """What ``folder``'s marker says (its ``kind`` and what ``mark`` wrote beside it); empty where
    it has none, or not a readable one."""
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def marker_kind(folder: Path) -> str | None:
    """The kind named by ``folder``'s marker, None where it has none (or not a readable one)."""
    return marker_info(folder).get("kind")


def unique_tmp(folder: Path, prefix: str) -> Path:
    """A temporary file's name in ``folder`` that no other process picks, on any host (pids repeat
    across hosts, and across containers of one host): ``prefix``, host, pid, random, ``.tmp``."""
    return folder / f"{prefix}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def mark(folder: Path, kind: str, **info) -> None:
    # A name of this process's own: several processes may mark one folder at once.
    tmp = unique_tmp(folder, MARKER + ".")
    tmp.write_text(json.dumps({"kind": kind, "by": "moe_ep", **info}))
    os.replace(tmp, folder / MARKER)


def run_own_entry(name: str) -> bool:
    """A file the ranks' start-up writes may show for an instant in any folder they check: a marker
    (or its temporary), a peer's write check."""
    return name.startswith((MARKER, WRITE_CHECK_PREFIX))


def is_empty_dir(path: Path) -> bool:
    """A folder holding nothing (but, at most, a marker being written or a peer's write check)."""
    return path.is_dir() and all(run_own_entry(p.name) for p in path.iterdir())


def ours(path: Path, kind: str) -> bool:
    """Whether a run may delete or replace ``path``: a folder carrying ``kind``'s marker, or
    an empty folder."""
    return path.is_dir() and (marker_kind(path) == kind or is_empty_dir(path))


def not_ours_message(path: Path, flag: str) -> str:
    kind = marker_kind(path)
    if kind is not None:
        return (f"{flag}: {path} was made by moe_ep for something else (its {MARKER} marker says {kind!r}); a run "
                f"never writes into or deletes another run's or tool's folder: choose another {flag}")
    return (f"{flag}: {path} was not made by moe_ep (it has no {MARKER} marker); moe_ep never writes "
            f"into or deletes a folder it did not make: move it away or choose another {flag}")


def holds_nothing_of_the_users(path: Path, managed: tuple[str, ...]) -> bool:
    """Nothing in ``path`` but a marker, the lock (which rank 0 may be creating while its peers
    check), a peer's write check and ``managed`` subfolders that carry their own marker (a run's
    checkpoints copied into a new folder)."""
    return path.is_dir() and all(run_own_entry(p.name) or p.name == LOCK_FILE
                                 or (p.name in managed and not p.is_symlink() and marker_kind(p) == p.name)
                                 for p in path.iterdir())


def check_output_dir_is_ours(path: Path, kind: str, managed: tuple[str, ...], flag: str = "--output-dir") -> None:
    """Before any work: an existing output folder is a folder that either carries ``kind``'s
    marker or holds nothing of the user's (``holds_nothing_of_the_users``: a new or empty folder is
    taken over); a folder of the user's, or one moe_ep made for something else (another script's
    run, a run's checkpoints), is refused."""
    if not path.exists():
        return
    if not path.is_dir():
        raise UsageError(f"{flag}: {path} exists and is not a folder")
    if marker_kind(path) != kind and not holds_nothing_of_the_users(path, managed):
        raise UsageError(not_ours_message(path, flag))


def make_managed_dir(path: Path, kind: str) -> Path:
    """Create ``path`` (a managed subfolder of a run) with its marker, or check that an existing one
    is ours; an empty folder is taken over."""
    path.mkdir(parents=True, exist_ok=True)
    if marker_kind(path) != kind:
        if not is_empty_dir(path):
            raise UsageError(not_ours_message(path, "--output-dir"))
        mark(path, kind)
    return path


def link_or_folder(path: Path) -> str | None:
    """``"a link"``, ``"a folder"`` or None: what ``path`` is where a file is expected."""
    return "a link" if path.is_symlink() else "a folder" if path.is_dir() else None


def check_odd_entries(output_dir: Path, flag: str = "--output-dir") -> None:
    """Before any work: an output folder that is a dangling link, a folder or a link where the run
    keeps a file (``metrics.jsonl``, the lock, a marker) and a link where it keeps a folder (its
    managed subfolders, anything in ``checkpoints/``) are refused by name: a run writes, and
    ``--overwrite`` or pruning delete, nothing through a link."""
    if output_dir.is_symlink() and not output_dir.exists():
        raise UsageError(f"{flag}: {output_dir} is a link to {os.readlink(output_dir)}, which does not exist; "
                         f"point it at a folder or choose another {flag}")
    if not output_dir.is_dir():
        return
    files = [output_dir / name for name in RUN_FILES]
    for name in MANAGED:
        folder = output_dir / name
        if folder.is_symlink():
            raise UsageError(f"{flag}: {folder} is a link (to {os.readlink(folder)}) where the run keeps its folder "
                             f"{name}; moe_ep never writes or deletes through a link: make it a folder or move it away")
        if folder.is_dir():
            files.append(folder / MARKER)
    for path in files:
        if (what := link_or_folder(path)) is not None:
            raise UsageError(f"{flag}: {path} is {what} where the run keeps its file {path.name}; moe_ep never writes "
                             "through a link or over a folder: move it away")
    refuse_linked_checkpoints(output_dir / "checkpoints", lambda name: True, flag)


def refuse_linked_checkpoints(folder: Path, among_them, flag: str = "--output-dir") -> None:
    """A link in the checkpoint folder ``folder`` whose name ``among_them`` says is the run's (a
    checkpoint's, a leftover's, an abandoned branch's): refused by name before any work."""
    if not folder.is_dir():
        return
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() and among_them(entry.name):
            raise UsageError(f"{flag}: {entry} is a link (to {os.readlink(entry)}) among the run's checkpoints; "
                             "moe_ep never reads, prunes or deletes a checkpoint through a link: move it away")


def refuse_link(path: Path) -> None:
    """Raise RunError where ``path``, about to be deleted, is a link: nothing is deleted through one
    (check_odd_entries refused any before the run; this holds for what appeared since)."""
    if path.is_symlink():
        raise RunError(f"{path} is a link (to {os.readlink(path)}); moe_ep never deletes through a link: move it away")


def check_run_folder(output_dir: Path) -> None:
    """Before any work: nothing odd where the run keeps its files and folders (check_odd_entries),
    and every managed name that exists in ``output_dir`` is the run's own, since runs write into
    them and ``--overwrite`` deletes them."""
    check_odd_entries(output_dir)
    # The user's files under the run's names first: the most precise thing to say.
    for name in MANAGED:
        path = output_dir / name
        if path.exists() and not ours(path, name):
            raise UsageError(not_ours_message(path, "--output-dir"))
    metrics = output_dir / METRICS
    # Under another kind's marker the folder is moe_ep's for something else: said just below.
    if metrics.exists() and marker_kind(output_dir) is None:
        raise UsageError(f"--output-dir: {metrics} was not written by moe_ep (the folder has no {MARKER} "
                         "marker); moe_ep never appends to or deletes a file it did not make: move it away or "
                         "choose another --output-dir")
    check_output_dir_is_ours(output_dir, "run", MANAGED)


def delete_atomically(path: Path) -> None:
    """Rename ``path`` to a ``.trash-`` name beside it (atomic), then delete it: whenever the
    deletion stops, nothing is left under the old name. Only for folders that are ours; never
    through a link."""
    trash = path.with_name(TRASH_PREFIX + path.name)
    refuse_link(path)
    refuse_link(trash)
    if trash.exists():  # left by an earlier interrupted deletion
        shutil.rmtree(trash)
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash)


def clear_run(output_dir: Path) -> None:
    """What --overwrite deletes: the run's checkpoints, metrics and TensorBoard logs (the token cache
    stays), and what an interrupted --overwrite left; only what carries the run's markers
    (check_run_folder refused anything else before any work)."""
    for name in ("checkpoints", "tensorboard"):
        path = output_dir / name
        if path.exists() and ours(path, name):
            delete_atomically(path)
    for name in ("checkpoints", "tensorboard"):
        leftover = output_dir / (TRASH_PREFIX + name)
        refuse_link(leftover)
        if leftover.exists() and ours(leftover, name):
            shutil.rmtree(leftover)
    if marker_kind(output_dir) == "run":
        (output_dir / METRICS).unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------- exports


def related(a: Path, b: Path) -> str | None:
    """How folder ``a`` relates to ``b`` ("is", "is an ancestor of", "is inside"), None if apart."""
    a, b = a.resolve(), b.resolve()
    if a == b:
        return "is"
    if a in b.parents:
        return "is an ancestor of"
    if b in a.parents:
        return "is inside"
    return None


# What save_pretrained writes: the files of an export made before its marker listed them.
_SAVE_PRETRAINED_FILE = re.compile(r"(config|generation_config)\.json|model(-\d{5}-of-\d{5})?\.safetensors"
                                   r"|model\.safetensors\.index\.json")


def export_files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the run's own entries (marker, write checks), relative to it."""
    return sorted(rel for p in folder.rglob("*") if (p.is_file() or p.is_symlink()) and not run_own_entry(p.name)
                  and (rel := p.relative_to(folder).as_posix()))


def files_added_to_export(folder: Path) -> list[str]:
    """The files of the earlier export ``folder`` that it did not write (a tokenizer, notes copied in
    since): its marker lists what it wrote; one made before that was recorded wrote what
    save_pretrained writes."""
    written = marker_info(folder).get("files")
    if isinstance(written, list):
        return [name for name in export_files(folder) if name not in written]
    return [name for name in export_files(folder) if not _SAVE_PRETRAINED_FILE.fullmatch(name)]


def check_export_target(out_dir: Path, protected: dict[str, Path], flag: str) -> None:
    """An export writes to a new folder, an empty one, or one a previous export made (its marker);
    never to or around ``protected`` folders (the run folder, the checkpoint), never over a user's
    files. Also the ``.tmp-``/``.trash-`` names beside it, which the export uses."""
    out_dir = Path(out_dir).resolve()  # "." and "..": the names beside it need a name
    clashes = [(relation, what, path) for what, path in protected.items()
               if (relation := related(out_dir, path)) is not None]
    if clashes:
        # The closest relation first: the folder itself, then one it is inside, then one it holds.
        relation, what, path = min(clashes, key=lambda c: ("is", "is inside", "is an ancestor of").index(c[0]))
        raise UsageError(f"{flag} {out_dir} {relation} {what} {path}; an export goes to a folder of its own "
                         "outside it (e.g. a sibling)")
    # Inside another run's folders (its checkpoints/, a token cache), an export would be taken for
    # one of that run's own, a damaged checkpoint say.
    managed = next((p for p in out_dir.parents if marker_kind(p) is not None), None)
    if managed is not None:
        raise UsageError(f"{flag} {out_dir} is inside {managed}, a folder a moe_ep run manages (its marker says "
                         f"{marker_kind(managed)!r}); an export goes to a folder of its own outside it")
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{flag}: {out_dir} exists and is not a folder")
    if out_dir.exists() and not ours(out_dir, "export"):
        raise UsageError(f"{flag}: {out_dir} is a non-empty folder that no moe_ep export wrote (it has no {MARKER} "
                         "marker); an export never replaces a user's files: choose a new or empty folder")
    added = files_added_to_export(out_dir) if out_dir.is_dir() and marker_kind(out_dir) == "export" else []
    if added:
        shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        raise UsageError(f"{flag}: {out_dir} is an earlier export that also holds files it did not write ({shown}); "
                         "an export replaces its folder whole and never deletes a user's files: move them away or "
                         f"choose another {flag}")
    for prefix in (".tmp-", TRASH_PREFIX):
        beside = out_dir.with_name(prefix + out_dir.name)
        if beside.exists() and not ours(beside, "export"):
            raise UsageError(f"{flag}: {beside}, the name the export uses while it writes, holds files that no "
                             "moe_ep export wrote; move it away")


# ------------------------------------------------------------------------------- free space


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_writable(path: Path, flag: str) -> None:
    """Create and delete a file in ``path`` (or the folder that will hold it): the only check that
    sees read-only mounts, permissions, ACLs and NFS root squashing alike."""
    folder = existing_ancestor(path)
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=WRITE_CHECK_PREFIX):
            pass
    except OSError as err:
        raise UsageError(f"{flag}: cannot write in {folder}: {err.strerror or err}") from None


def check_appendable(path: Path, flag: str) -> None:
    """Where the run's log ``path`` exists, open it for appending and write nothing: a log made
    read-only, or another user's, was found only at the run's first record, after start-up (and
    any deletion ``--overwrite`` asked for)."""
    if not path.is_file():
        return
    try:
        with open(path, "ab"):
            pass
    except OSError as err:
        raise UsageError(f"{flag}: cannot append to {path}: {err.strerror or err}") from None


def check_free_space(path: Path, needed: int, what: str, flag: str, *, reclaimable: int = 0) -> None:
    """``needed`` bytes free on the file system of ``path``, counting ``reclaimable`` bytes (the run's
    own leftovers, which it removes before it writes) as free."""
    folder = existing_ancestor(path)
    free = shutil.disk_usage(folder).free
    if free + reclaimable < needed:
        leftovers = (f" (and {reclaimable / 2**30:,.2f} GiB in leftovers of interrupted saves, removed at start)"
                     if reclaimable else "")
        raise UsageError(f"{flag}: {free / 2**30:,.2f} GiB free on the file system of {folder}{leftovers}, but "
                         f"{what} take about {needed / 2**30:,.2f} GiB; free some space or choose another {flag}")


def leftover_bytes(checkpoints: Path) -> int:
    """Bytes held by the ``.tmp-`` and ``.trash-`` folders of a checkpoints folder that is the run's:
    interrupted saves and deletions, which the run removes at start."""
    if not ours(checkpoints, "checkpoints"):
        return 0
    # A job still running there (whose lock refuses this one just after) renames and deletes them
    # meanwhile: what is gone counts for nothing (os.walk passes over what vanishes mid-walk).
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in checkpoints.iterdir():
            if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and entry.is_dir() and not entry.is_symlink():
                for folder, _, names in os.walk(entry):
                    for name in names:
                        with contextlib.suppress(FileNotFoundError):
                            path = Path(folder, name)
                            total += path.stat().st_size if path.is_file() else 0
    return total


def checkpoints_to_come(existing: int, keep: int | None) -> int:
    """How many more checkpoints the disk must hold: a save writes the new one before it prunes, so
    a run holds ``keep + 1`` at its peak, of which the ``existing`` complete ones already on disk (a
    manifest: not an empty or cut-short folder, which holds less) are paid for; at least one more,
    whatever is there (the only bound where every checkpoint is kept, ``keep`` None)."""
    return 1 if keep is None else max(1, keep + 1 - existing)


# ------------------------------------------------------------------------------------ the lock


def job_id() -> str:
    """What names this job in the lock: the launcher's rendezvous (its store's address is unique
    among live jobs), else this process."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    master = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    return f"{master} run {run}" if master != ":" else f"pid {os.getpid()}"


class OutputLock:
    """Rank 0's exclusive lock on an output folder (see the module's docstring). ``lock_name``,
    ``flag``: a lock file of another name in ``folder`` and the flag its refusal names (an export's
    lock beside the folder it replaces, ``export_lock``)."""

    def __init__(self, folder: Path, *, lock_name: str = LOCK_FILE, flag: str = "--output-dir"):
        self.path = folder / lock_name
        self.flag = flag
        self._fd: int | None = None

    def acquire(self) -> dict | None:
        """Take the lock or raise UsageError naming its holder. Returns the record left by a job
        that died holding it, if any."""
        # Never deleted: a lock file unlinked and re-created would let two jobs lock two inodes.
        # Never through a link (the record would overwrite its target).
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if (what := link_or_folder(self.path)) is None:
                raise UsageError(f"{self.flag}: cannot write in {self.path.parent}: {err.strerror or err}") from None
            raise UsageError(f"{self.flag}: {self.path} is {what} where moe_ep keeps its lock file; move it "
                             "away") from err
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EACCES, errno.EAGAIN):
                raise UsageError(f"{self.flag} {self.path.parent} is in use by another job ({self.holder()}); "
                                 f"wait for it to end or choose another {self.flag} (--overwrite does not "
                                 "override this)") from None
            raise UsageError(f"{self.flag}: cannot lock {self.path} ({err.strerror}); the lock keeps a second job "
                             "out of the folder: use a file system with POSIX locks (NFSv4, GPFS, BeeGFS, Lustre "
                             "mounted with -o flock)") from None
        self._fd = fd
        previous = self._read(fd)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        return previous

    @staticmethod
    def _read(fd: int) -> dict | None:
        raw = os.pread(fd, 1 << 16, 0)
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            return {"unreadable": raw[:200].decode(errors="replace")}

    def holder(self) -> str:
        try:
            with open(self.path, "rb") as f:
                record = self._read(f.fileno())
        except OSError:
            record = None
        return describe_holder(record) if record else "its holder has not written its name yet"

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing releases the lock
        self._fd = None


@contextmanager
def hold_output_dir(folder: Path, *, rank: int):
    """The job's hold on ``folder``: global rank 0 takes the lock (or raises UsageError naming its
    holder) and lets go on exit; the other ranks join the job through the process group, which
    forms only once rank 0 holds the lock. Yields the record of a job that died holding it (rank 0;
    None elsewhere), for a warning."""
    lock = OutputLock(folder)
    previous = lock.acquire() if rank == 0 else None
    try:
        yield previous
    finally:
        lock.release()


@contextlib.contextmanager
def export_lock(out_dir: Path, flag: str):
    """Held while an export writes ``out_dir``: its lock file beside it (the folder itself is
    replaced by a rename), ``.moe_ep-lock-NAME``. Two exports to one folder each took the other's
    ``.tmp-`` folder for a leftover and deleted it, and could leave one's weights under the
    other's marker. Raises UsageError naming the holder."""
    lock = OutputLock(out_dir.parent, lock_name=f"{LOCK_FILE}-{out_dir.name}", flag=flag)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def describe_holder(record: dict) -> str:
    if "unreadable" in record:
        return f"lock record {record['unreadable']!r}"
    return f"pid {record.get('pid')} on host {record.get('host')}, job {record.get('job')}, since {record.get('since')}"


# Bytes per parameter of one checkpoint: float32 weights and AdamW's two float32 moments.
CHECKPOINT_BYTES_PER_PARAMETER = 12
EXPORT_BYTES_PER_PARAMETER = 4
# What the format adds to them: DCP's metadata and each tensor's header, each rank's RNG state, the
# trainer state, config and manifest (3% for a 3.4M-parameter model saved by 2 ranks).
CHECKPOINT_MARGIN, CHECKPOINT_FIXED_BYTES = 1.05, 4 << 20


def checkpoint_bytes(parameters: int) -> int:
    """About what one checkpoint of ``parameters`` parameters takes on disk, rounded up."""
    return int(CHECKPOINT_MARGIN * CHECKPOINT_BYTES_PER_PARAMETER * parameters) + CHECKPOINT_FIXED_BYTES


def check_output_folders(output_dir: Path, export_dir: Path | None, parameters: int, *, keep: int,
                         also: tuple[int, str] | None = None) -> None:
    """Before any work: the run folder holds nothing of the user's under the run's names and
    nothing odd (check_odd_entries), every folder the run writes to is writable and has room for
    the checkpoints to come (``keep`` kept, one more while a save is written; the run's own leftovers
    counted as free), for ``also`` (bytes, what: anything else the run writes into its folder, such
    as a token cache) and for the export, and the export goes where it deletes nothing of the user's."""
    check_run_folder(output_dir)
    for folder in (output_dir, *(output_dir / name for name in MANAGED if (output_dir / name).is_dir())):
        check_writable(folder, "--output-dir")
    check_appendable(output_dir / METRICS, "--output-dir")
    checkpoints = output_dir / "checkpoints"
    existing = sum(1 for p in checkpoints.iterdir() if p.name.startswith("step_") and (p / MANIFEST).is_file()
                   ) if checkpoints.is_dir() else 0
    count = checkpoints_to_come(existing, keep)
    what = (f"{count} more checkpoint{'s' if count > 1 else ''} (weights and AdamW state; --keep-checkpoints {keep} "
            "and one more while a save is written)")
    needed = {existing_ancestor(output_dir).stat().st_dev: [count * checkpoint_bytes(parameters),
                                                             what, output_dir, "--output-dir"]}
    if also is not None:
        needed[existing_ancestor(output_dir).stat().st_dev][0] += also[0]
        needed[existing_ancestor(output_dir).stat().st_dev][1] += f" and {also[1]}"
    if export_dir is not None:
        export_dir = Path(export_dir).resolve()  # "." is written beside, in its parent
        check_export_target(export_dir, {"the run folder (--output-dir)": output_dir}, "--export-dir")
        check_writable(export_dir.parent, "--export-dir")
        device = existing_ancestor(export_dir).stat().st_dev
        if device in needed:
            needed[device][0] += EXPORT_BYTES_PER_PARAMETER * parameters
            needed[device][1] += " and the export"
        else:
            needed[device] = [EXPORT_BYTES_PER_PARAMETER * parameters, "the export", export_dir, "--export-dir"]
    reclaimable = leftover_bytes(output_dir / "checkpoints")
    for size, what, folder, flag in needed.values():
        check_free_space(folder, size, what, flag, reclaimable=reclaimable if folder == output_dir else 0)
