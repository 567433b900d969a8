"""`threefold train --max-restarts N [--min-world M]`: a job that restarts itself when ranks fail.

The launcher (runtime/launch.py) already bounds a failure: a rank that dies, or stops
(SIGSTOP: seen by the launcher within a second, its peers told through the job's store),
makes the others fail within THREEFOLD_TIMEOUT, and every rank is then ended. Here the job
goes on: it restarts from the newest complete checkpoint (checkpoints are published only
whole: checkpoint/save.py), on the same world when the lost ranks come back, else on the
largest world >= M that derives a plan from the old one (train/elastic_plan.py), and the
first step after the restart records what happened (the loop's `restart` record: step,
old and new plan, seconds and steps lost).

Local ranks always come back (the machine is still there), so a local restart keeps the
world; THREEFOLD_ELASTIC_DROP_DEAD=1 counts the ranks that died or stopped as gone for good,
which is what a lost node does to a multi-node job (and how the tests take the smaller
world). Under torchrun its elastic agent restarts the processes itself
(`torchrun --max-restarts N --nnodes MIN:MAX`); each restarted process resumes the newest
checkpoint, deriving the plan when the agent gave it fewer ranks (`torchrun_resume`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from threefold.errors import PlanError
from threefold.runtime.launch import LaunchError
import fcntl
from threefold.workload import load_spec
from threefold.plan import Plan

DROP_DEAD_ENV = "THREEFOLD_ELASTIC_DROP_DEAD"


def run_elastic(cfg, plan, resume, live: str | None, ckpt_dir: str, start, check_plan) -> dict:
    """Rank 0's result of the run; `start(cfg, plan, resume, restart)` runs one attempt on
    plan.world_size ranks (raising LaunchError when ranks fail), `check_plan(cfg)` compiles
    a derived plan in this process (PlanError if the model cannot run it) and returns it."""
    restart, left = None, cfg.max_restarts
    while True:
        try:
            return start(cfg, plan, resume, restart)
        except LaunchError as exc:
            if left <= 0 or any(str(v).startswith("PlanError: ") for v in exc.errors.values()):
                raise
            failed_at = time.time()
            left -= 1
            lost = _lost_ranks(exc)
            old = plan
            if lost:
                cfg, plan, why = _smaller(cfg, plan, plan.world_size - len(lost), check_plan, exc)
            committed = _settle(ckpt_dir)   # a save killed mid-write: its staged copy (checkpoint/staging.py)
            resume = _newest(ckpt_dir) or resume    # none saved yet: where this run itself began
            restart = {"old_plan": str(old), "old_world": old.world_size, "new_world": plan.world_size,
                       "failed_at": failed_at, "reached_step": _reached_step(live),
                       "cause": _first_line(exc), "restarts_left": left}
            where = f"from {resume}" if resume else "from the start (no checkpoint yet)"
            if committed and resume == committed:
                where += " (committed from the snapshot staged before the failure)"
            shape = (f"on plan {plan} ({why}; lost rank(s) {', '.join(map(str, lost))})" if plan != old
                     else f"on the same {plan.world_size} ranks")
            print(f"threefold train: {restart['cause']}; restarting {where} {shape} "
                  f"({left} restart(s) left)", file=sys.stderr)


def _settle(ckpt_dir: str) -> str | None:
    """Commit the staged snapshot of a save the failure interrupted, if every rank sealed
    it (the newest checkpoint then), and remove the staged files; its path or None."""
    # lazy: start-up: threefold.checkpoint.staging loads 3 more modules only when this runs
    from threefold.checkpoint.staging import settle
    return settle(ckpt_dir)


def settle_under_torchrun(ckpt_dir: str) -> None:
    """Under torchrun every restarted process comes here before any resumes: the first on
    this host to take the lock settles the snapshots the failed attempt staged here (the
    others wait for it, then find nothing left)."""

    # lazy: start-up: threefold.checkpoint.staging loads 3 more modules only when this runs
    from threefold.checkpoint.staging import settle, stage_dir
    directory = stage_dir(ckpt_dir)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC) if directory else None
    except OSError:          # none staged here (or another process settled them already)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        settle(ckpt_dir)
    finally:
        os.close(fd)


def _lost_ranks(exc) -> list[int]:
    """Ranks that will not come back: none locally, unless THREEFOLD_ELASTIC_DROP_DEAD=1
    (then those the launcher saw die or stop)."""
    if os.environ.get(DROP_DEAD_ENV, "") not in ("1", "true", "yes"):
        return []
    return sorted(getattr(exc, "causes", {}) or {})


def _smaller(cfg, plan, world: int, check_plan, exc):
    """The largest world >= --min-world with a plan derived from `plan` that compiles."""
    # lazy: start-up: threefold.train.elastic_plan loads 2 more modules only when this runs
    from threefold.train.elastic_plan import smaller_plans
    floor = cfg.min_world or plan.world_size
    tried = []
    for candidate, why in smaller_plans(plan, world, floor, cfg.batch if cfg.spec is None else None, ranker(cfg)):
        trial = dataclasses.replace(cfg, plan=str(candidate))
        try:
            checked = check_plan(trial)
            return dataclasses.replace(cfg, plan=str(checked)), checked, why
        except PlanError as err:
            tried.append(f"{candidate}: {err}")
    detail = f" (tried {'; '.join(tried[:2])})" if tried else ""
    raise PlanError(f"{_first_line(exc)}; {world} rank(s) left, and no plan derived from {plan} runs on "
                    f"{world} down to --min-world {floor} ranks{detail}: lower --min-world or bring the ranks back")


PLANNER_CLUSTER = "a100-80gb"     # `threefold plan`'s default cluster: the planner's prices


def ranker(cfg):
    """`rank(plans, world)` for smaller_plans: the planner's order (elastic_plan.planner_order)
    over this job's model cost and global batch, priced on first use (a dp shrink needs no
    model cost); [] (the fixed order) where the model cannot be priced, said once on stderr."""
    priced: list = []

    def rank(plans, world):
        if not priced:
            try:
                # lazy: start-up: the planner loads only when a restart must change the shape
                from threefold.planner.cluster import load_cluster
                priced.append((*_model_cost(cfg), load_cluster(PLANNER_CLUSTER)))
            except Exception as exc:     # the planner is advice: without it the fixed order still works
                priced.append(None)
                print(f"threefold train: the planner cannot price this model ({type(exc).__name__}: "
                      f"{str(exc).strip()[:160]}); smaller plans in the fixed order (pp, then tp, halved)",
                      file=sys.stderr)
        if priced[0] is None:
            return []
        # lazy: start-up: threefold.train.elastic_plan loads 2 more modules only when this runs
        from threefold.train.elastic_plan import planner_order
        model, batch, cluster = priced[0]
        return planner_order(plans, model, batch, cluster)
    return rank


def _model_cost(cfg):
    """(ModelCost, global batch) of the job: the embedded GPT's shape, or the SPEC traced."""
    if cfg.spec is None:
        # lazy: start-up: the planner loads only when a restart must change the shape
        from threefold.dataset import load_data
        from threefold.planner.gpt_cost import gpt_model_cost  # lazy: start-up: as above
        vocab = load_data(cfg).vocab_size
        return gpt_model_cost(cfg.n_layer, cfg.n_embd, cfg.n_head, vocab, cfg.seq), cfg.batch
    # lazy: start-up: threefold.compiler.trace loads 12 more modules only when this runs
    from threefold.compiler.trace import trace
    # lazy: start-up: threefold.planner.spec_cost loads 16 more modules only when this runs
    from threefold.planner.spec_cost import model_cost_from_program
    # lazy: start-up: threefold.train.source loads 1 more modules only when this runs
    from threefold.train.source import given_sizes
    work = load_spec(cfg.spec, given_sizes(cfg))
    traced = trace(work.model, work.inputs, work.target, work.loss_fn)
    return model_cost_from_program(traced, work.inputs, cfg.spec), int(work.inputs[0].shape[0])


def _newest(ckpt_dir: str) -> str | None:
    # lazy: start-up: threefold.checkpoint.files loads 1 more modules only when this runs
    from threefold.checkpoint.files import list_steps
    steps = list_steps(ckpt_dir)
    return os.path.join(ckpt_dir, steps[-1]) if steps else None


def _reached_step(live: str | None) -> int | None:
    """The last step rank 0 logged before the failure (the live metrics.jsonl)."""
    path = os.path.join(live, "metrics.jsonl") if live else None
    if not path or not os.path.isfile(path):
        return None
    step = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
    return step


def _first_line(exc) -> str:
    causes = getattr(exc, "causes", None)
    if causes:     # what the launcher saw: "rank 1 died (killed by SIGKILL)"
        return "; ".join(causes.values())[:300]
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def torchrun_resume(cfg, ckpt_dir: str):
    """Under torchrun's elastic agent (TORCHELASTIC_RESTART_COUNT > 0), a restarted process
    resumes the newest checkpoint; when the agent gave fewer ranks than the checkpoint's
    plan, the plan is derived for them. Returns (cfg, resume or None, note or None, the
    restart's record or None); the time lost counts from this process's start."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if count <= 0 or not cfg.save_every:
        return cfg, None, None, None
    settle_under_torchrun(ckpt_dir)
    newest = _newest(ckpt_dir)
    if newest is None:
        return cfg, None, None, None
    # lazy: start-up: threefold.checkpoint.reader loads 3 more modules only when this runs
    from threefold.checkpoint.reader import read_index
    # lazy: start-up: threefold.train.elastic_plan loads 2 more modules only when this runs
    from threefold.train.elastic_plan import plan_for_world
    old = Plan.parse(read_index(newest).get("plan", cfg.plan))
    world = int(os.environ["WORLD_SIZE"])
    restart = {"old_plan": str(old), "old_world": old.world_size, "new_world": world, "failed_at": _started(),
               "cause": f"torchrun's agent restarted the job (restart {count})"}
    if old.world_size == world:
        return dataclasses.replace(cfg, plan=str(old)), newest, None, restart
    plan, why = plan_for_world(old, world, cfg.batch if cfg.spec is None else None, ranker(cfg))
    return (dataclasses.replace(cfg, plan=str(plan)), newest, f"plan {old} -> {plan} on {world} ranks ({why})",
            restart)


def _started() -> float:
    """This process's start, as a Unix time (Linux /proc; else now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
