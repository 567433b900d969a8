"""Whose checkpoints are these: a run's identity, the folders it may write, and resume's checks.

`threefold train` records a run in every checkpoint's threefold.json ("run": an id drawn when
the run starts, kept by --resume, and the settings that define the run: seed, data,
tokenizer, SPEC, batch, seq; the plan is recorded but may change on resume, which reshards).
With it:
- a run prunes and replaces only its own checkpoints (save.py/files.publish), so `latest`
  never names a step another run wrote or a step this run pruned;
- a --ckpt-dir holding files threefold does not write (anything but step_<N>, latest, and
  save's temporaries) or an earlier run's checkpoints is refused unless --force (--resume
  continues the earlier run instead); with --force a user's `latest` is moved aside, never
  overwritten, and other files are left as they are;
- --resume refuses a checkpoint whose recorded settings differ from this run's.
"""
from __future__ import annotations

import os
import time
import uuid

from threefold.checkpoint import files
from threefold.errors import PlanError

IDENTITY = ("seed", "data", "tokenizer", "spec", "batch", "seq")


def _data_name(value):
    return os.path.abspath(value) if isinstance(value, str) and os.path.exists(value) else value


def run_record(cfg, resumed_index: dict | None = None) -> dict:
    """This run's record: the resumed run's id (its pruning continues), else a new one."""
    run = (resumed_index or {}).get("run") or {}
    record = {"id": run.get("id") if isinstance(run.get("id"), str) else uuid.uuid4().hex,
              "plan": str(getattr(cfg, "plan", ""))}
    for key in IDENTITY:
        value = getattr(cfg, key, None)
        record[key] = _data_name(value) if key in ("data", "spec", "tokenizer") else value
    return record


def check_same_run(ckpt: str, index: dict, record: dict) -> None:
    """--resume of a checkpoint another run wrote (other seed, data, SPEC...) is refused."""
    theirs = index.get("run")
    if not isinstance(theirs, dict):
        return       # saved by threefold.save outside threefold train: nothing recorded to compare
    for key in IDENTITY:
        if key in theirs and theirs[key] != record.get(key):
            raise PlanError(f"--resume {ckpt}: that checkpoint is another run's ({key} {theirs[key]!r}, this run "
                            f"{record.get(key)!r}): give the same settings to continue it, or a new --ckpt-dir")


def is_ours(root: str, name: str) -> bool:
    """A name threefold writes in a checkpoint root."""
    path = os.path.join(root, name)
    if files.STEP_DIR.fullmatch(name) or files.PARTIAL.fullmatch(name) or files.RUN_ASIDE.fullmatch(name):
        return os.path.isdir(path) and not os.path.islink(path)
    if name == files.LATEST + ".tmp" or name.startswith(files.LATEST + ".moved-aside-"):
        return True
    return name == files.LATEST and _latest_is_ours(root)


def _latest_is_ours(root: str) -> bool:
    path = os.path.join(root, files.LATEST)
    try:
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 64:
            return False
        with open(path, "rb") as f:
            name = f.read(65).decode("ascii", "replace").strip()
    except OSError:
        return False
    return bool(files.STEP_DIR.fullmatch(name))


def check_ckpt_dir(ckpt_dir: str, force: bool, resuming_from: str | None, record: dict) -> str | None:
    """Refuse (unless --force) a --ckpt-dir holding a user's files or an earlier run's
    checkpoints (one this run does not resume). With --force a user's `latest` is moved
    aside; returns the name it was moved to (None if none)."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PlanError(f"--ckpt-dir {ckpt_dir!r} cannot be read ({exc.strerror or exc})") from None
    foreign = [n for n in names if not is_ours(ckpt_dir, n)]
    if foreign and not force:
        shown = ", ".join(foreign[:3]) + (f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else "")
        raise PlanError(f"--ckpt-dir {ckpt_dir!r} holds files threefold did not write ({shown}): give an empty "
                        "or new directory, or --force to write checkpoints beside them (they are kept)")
    others = [n for n in files.list_steps(ckpt_dir) if _run_id(ckpt_dir, n) != record["id"]]
    same_root = resuming_from is not None and os.path.realpath(resuming_from) == os.path.realpath(ckpt_dir)
    if others and not same_root and not force:
        raise PlanError(f"--ckpt-dir {ckpt_dir!r} holds an earlier run's checkpoints ({others[-1]}): pass --resume "
                        "to continue it, give a new --ckpt-dir, or --force to start a new run beside them "
                        "(they are kept)")
    if force and os.path.lexists(os.path.join(ckpt_dir, files.LATEST)) and not _latest_is_ours(ckpt_dir):
        aside = f"{files.LATEST}.moved-aside-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(os.path.join(ckpt_dir, files.LATEST), os.path.join(ckpt_dir, aside))
        return aside
    return None


def _run_id(root: str, name: str):
    return files.run_id_of(os.path.join(root, name))
