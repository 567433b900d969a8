"""A pp=2, tp=2, dp=2 job on 8 local ranks whose rank VICTIM sends itself SIGNAL mid-step.

    python tests/safety_fault_job.py PIDDIR VICTIM SIGNAL     (VICTIM -1: no fault)

Each step does what a training step does on the wire, through the runtime's own helpers:
a tensor-parallel all-reduce (tp_ops), a pipeline send/receive pair (comm), a data-parallel
all-reduce (comm). Every rank writes its pid into PIDDIR; the victim writes `fault` with
the time just before it signals itself. Exit status: 0 finished, 3 LaunchError (printed),
143 terminated.
"""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_job(piddir: str, victim: int, signame: str, steps: int = 40):
    import torch
    import torch.distributed as dist

    from threefold.runtime import comm, tp_ops
    from threefold.runtime.mesh import Mesh
    rank = dist.get_rank()
    mesh = Mesh(tp=2, dp=2, pp=2)
    groups = comm.build_groups(mesh, rank)
    with open(os.path.join(piddir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    coord = mesh.coord(rank)
    x = torch.ones(4)
    for step in range(steps):
        if rank == victim and step == 3:
            with open(os.path.join(piddir, "fault"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), getattr(signal, signame))
        y = tp_ops._all_reduce(x, groups.tp)
        peer = mesh.moved(mesh.rank(tp=coord.tp, dp=coord.dp, pp=coord.pp), pp=1 - coord.pp)
        if coord.pp == 0:
            comm.send([y], peer, f"activations step {step}").wait()
            (g,) = comm.recv([((4,), torch.float32)], peer, f"gradients step {step}", torch.device("cpu"))
        else:
            (a,) = comm.recv([((4,), torch.float32)], peer, f"activations step {step}", torch.device("cpu"))
            comm.send([a], peer, f"gradients step {step}").wait()
        comm.all_reduce(y, groups.dp, "gradients")
        time.sleep(0.05)
    return step


if __name__ == "__main__":
    from threefold.errors import Terminated
    from threefold.runtime.launch import LaunchError, launch
    piddir, victim, signame = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(os.path.join(piddir, "launcher"), "w") as f:
        f.write(str(os.getpid()))
    try:
        launch(rank_job, 8, piddir, victim, signame, timeout=300)
    except LaunchError as exc:
        print(str(exc), file=sys.stderr)
        sys.exit(3)
    except Terminated as exc:
        print(f"terminated: {exc}", file=sys.stderr)
        sys.exit(143)
    print("finished")
