"""Expert parallelism for experts held as separate modules (passes/module_experts.py): each
expert runs on the one ep rank holding its parameters, on every ep rank's inputs.

Expert e of E belongs to ep rank e // (E/ep). For each of a rank's own rows:
    1. its inputs go to the experts' ranks (all-to-all): an input of its own per expert (a
       piece of the slots) goes to that expert's rank only; one tensor every expert reads
       (a dense mixture's tokens) goes once to every rank;
    2. each rank runs each of its experts on each source rank's inputs separately, exactly
       the ops one process runs for those rows (so no op needs to be row-wise);
    3. the results go home (all-to-all), in expert order; the combine (stack, cat, the sum
       of router-weighted outputs) runs on the home rank as traced, in the model's order.
Both exchanges are `_AllToAll` (runtime/experts.py), whose backward is the reverse exchange:
an input's gradient returns to its rank (summed over the experts that read it, by autograd)
and an expert's parameter gradient on its rank sums every ep rank's rows.

A rank keeps only its experts' parameters (`keep_local_modules`): the others become empty
tensors (no rows), so the optimizer holds state for its own experts only, and a checkpoint
stores each expert's parameters whole, from its rank (checkpoint/state.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.runtime.experts import _AllToAll


def run_module_experts(fns, inputs, params, group) -> tuple:
    """(fns[e](*inputs[e], *params[e]) for every expert e) for this rank's rows, each
    computed on the rank holding expert e; with no ep group (ep=1) a plain loop."""
    if group is None:
        return tuple(fn(*ins, *ps) for fn, ins, ps in zip(fns, inputs, params))
    n = len(fns)
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    local = n // ep
    there = []   # per input position: (source rank, local expert) -> that source's input
    for k in range(len(inputs[0]) if inputs else 0):
        col = [ins[k] for ins in inputs]
        if all(c is col[0] for c in col):   # read by every expert: once to every rank
            got = _AllToAll.apply(col[0].unsqueeze(0).expand(ep, *col[0].shape), [1] * ep, [1] * ep,
                                  group, "expert module inputs")
            there.append(lambda s, i, got=got: got[s])
        else:                               # one per expert: to its rank
            got = _AllToAll.apply(torch.stack(col), [local] * ep, [local] * ep, group, "expert module inputs")
            there.append(lambda s, i, got=got: got[s * local + i])
    outs = [fns[me * local + i](*(f(s, i) for f in there), *params[me * local + i])
            for s in range(ep) for i in range(local)]
    back = _AllToAll.apply(torch.stack(outs), [local] * ep, [local] * ep, group, "expert module outputs")
    return tuple(back.unbind(0))     # from rank k its experts' results: expert order


def owner(expert: int, experts: int, ep: int) -> int:
    """The ep rank holding expert `expert` of `experts`."""
    return expert // (experts // ep)


def keep_local_modules(module, ep_rank: int, ep: int) -> None:
    """Replace the parameters of the experts this ep rank does not hold (module.EXPERT_MODULES:
    FQN -> [expert, experts]) by empty tensors (no rows): the rank never runs those experts,
    and the optimizer holds no state for them."""
    for fqn, (expert, experts) in module.EXPERT_MODULES.items():
        if owner(expert, experts, ep) == ep_rank:
            continue
        full = module.p(fqn)
        empty = full.detach().new_empty((0, *full.shape[1:]))
        module._owner(fqn).register_parameter(fqn.rsplit(".", 1)[-1],
                                              torch.nn.Parameter(empty, requires_grad=full.requires_grad))
    module._state_cache = None
