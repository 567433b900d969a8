"""Optimizer parameter groups in a checkpoint, matched by the parameters they hold.

A checkpoint saves each group's hyperparameters (lr, betas, weight_decay, ...) with the
FQNs of its parameters, gathered over every rank (a rank holds only its stage's). At load,
each group of the optimizer being loaded takes the hyperparameters of the saved group that
holds its parameters, so an optimizer built with the same groups loads them in any order
and under any plan (a rank whose stage holds only some of them included). Per-parameter
state (AdamW's moments, step) is keyed by FQN and loads whatever the groups are.

A freshly built one-group optimizer, such as `pm.optimizer(torch.optim.AdamW, lr=...)`
loading the two groups (decayed, not) that `threefold train` saves, gets the state and
keeps its own hyperparameters: the user built it with them (a warning says so). Groups that
cut the saved ones differently otherwise (one group mixing parameters of two saved groups,
next to others) are a one-line PlanError on every rank. The decision is taken over all
ranks together, so every rank loads alike.
"""
from __future__ import annotations

import warnings

from threefold.checkpoint import state
from threefold.checkpoint.collective import gather_all, rank_world
from threefold.errors import PlanError

FQNS = "fqns"     # the key in a saved group that lists its parameters
# How the optimizer being loaded into runs its step, not hyperparameters of the run: they stay
# as it was built (a checkpoint saved unfused resumes fused where this machine allows it, and
# one saved fused on a CPU does not force fused onto parameters it cannot fuse).
HOW_IT_RUNS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def group_fqns(pm, optimizer) -> list[list[str]]:
    """The FQNs of this rank's parameters in each of `optimizer`'s groups."""
    by_id = {id(p): fqn for fqn, p, _ in state.optimizer_params(pm, optimizer)}
    return [[by_id[id(p)] for p in g["params"] if id(p) in by_id] for g in optimizer.param_groups]


def saved_groups(pm, optimizer) -> list[dict]:
    """What a checkpoint stores for the groups (every rank calls it: it gathers the FQNs)."""
    everyone = gather_all(group_fqns(pm, optimizer))
    groups = state.param_groups(optimizer)
    for i, g in enumerate(groups):
        g[FQNS] = sorted({f for rank in everyone if i < len(rank) for f in rank[i]})
    return groups


def restore_groups(pm, optimizer, saved: list[dict] | None) -> str:
    """Give each group its saved hyperparameters (see the module docstring). Returns
    "restored", "kept" (a one-group optimizer keeps its own) or "none" (nothing saved);
    a PlanError, raised on every rank, when the groups do not match."""
    if not saved:
        return "none"
    current = group_fqns(pm, optimizer)
    homes, verdict = _match(current, saved)
    verdicts = gather_all(verdict)
    problems = [v for v in verdicts if v not in ("restored", "kept")]
    if problems:
        raise PlanError(problems[0])
    if "kept" in verdicts:
        if rank_world()[0] == 0:
            warnings.warn(f"threefold.load: the checkpoint's optimizer had {len(saved)} parameter groups, this one "
                          f"has {len(current)}: its per-parameter state is loaded and it keeps its own "
                          "hyperparameters (lr, weight_decay, ...)", stacklevel=3)
        return "kept"
    for group, home in zip(optimizer.param_groups, homes):
        group.update({k: v for k, v in saved[home].items() if k not in ("params", FQNS) and k not in HOW_IT_RUNS})
    return "restored"


def _match(current: list[list[str]], saved: list[dict]) -> tuple[list[int], str]:
    """(the saved group each current group takes, this rank's verdict or problem)."""
    if not all(FQNS in g for g in saved):        # saved before groups recorded their parameters
        if len(saved) == len(current):
            return list(range(len(saved))), "restored"
        return [], "kept" if len(current) == 1 else _mismatch(len(saved), len(current))
    where = {f: i for i, g in enumerate(saved) for f in g[FQNS]}
    homes = []
    for i, names in enumerate(current):
        found = sorted({where[f] for f in names if f in where})
        if len(found) > 1:
            if len(current) == 1:
                return [], "kept"
            a = next(f for f in names if where.get(f) == found[0])
            b = next(f for f in names if where.get(f) == found[1])
            return [], (f"the optimizer's parameter group {i} holds {a} (saved in group {found[0]}) and {b} "
                        f"(saved in group {found[1]}): build the groups as they were saved, or one group "
                        "(which keeps its own hyperparameters)")
        homes.append(found[0] if found else min(i, len(saved) - 1))   # empty here: any
    return homes, "restored"


def _mismatch(saved: int, current: int) -> str:
    return (f"the checkpoint's optimizer has {saved} parameter groups, this one has {current}: build the "
            "optimizer as it was saved, or with one group (which keeps its own hyperparameters)")
