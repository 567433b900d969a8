"""One rank's training run: compile, then for each step set the learning rate, run the
parallel step, clip by the global gradient norm, update, log; evaluate every N steps;
checkpoint every N steps; at the end sample text from a language model.

Every rank runs this function with the same arguments (collectives in the same order);
rank 0 alone draws the progress bar and writes the log. What it returns (on rank 0) is what
the command writes into --out: the per-step rows, the losses, the sample.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist

from threefold.runtime.trace import NoTracer, StepTracer, parse_steps
from threefold.train.lr_schedule import WarmupCosine, set_lr
from threefold.train.source import Source


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def train_loop(cfg, model: torch.nn.Module, loss_fn, source: Source, *, batch_dims=None,
               show: bool = True, live_dir: str | None = None, ckpt_dir: str | None = None,
               resume: str | None = None, run: dict | None = None, restart: dict | None = None) -> dict:
    """`run`: this run's record (checkpoint/ownership.py), written into every checkpoint.
    `restart`: set when the job restarted itself after a failure (train/elastic.py): what
    it records (the plan before, the step reached); the first step run adds the time lost."""
    import threefold
    # lazy: start-up: train.evaluate loads only on this path
    from threefold.train.evaluate import due, validation_loss
    # lazy: start-up: train.metrics loads only on this path
    from threefold.train.metrics import MetricsLog, memory_per_rank, model_flops_per_step, tokens_per_second
    from threefold.train.optim import adamw   # lazy: start-up: train.optim loads only on this path
    from threefold.train.progress import Progress   # lazy: start-up: train.progress loads only on this path
    main = _is_main()
    progress = Progress(cfg.steps, enabled=show and main)
    with progress:
        example = source.peek()
        # (no loss_fn: the model returns its loss, a batch's target entry is not the model's)
        pm = threefold.parallelize(model, cfg.plan, example[:-1], loss_fn,
                                   target=example[-1] if loss_fn is not None else None,
                                   batch_dims=batch_dims, weights=getattr(cfg, "weights", None))
        opt = adamw(pm, cfg.lr, cfg.weight_decay, cfg.betas, getattr(cfg, "decay_embeddings", False))
        schedule = WarmupCosine(cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        flops_per_step = model_flops_per_step(pm)
        tokens_per_step = int(example[0].numel())
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        scaled = hasattr(opt, "scaler")   # fp16's loss-scaled optimizer (runtime/optimizers.py)
        rows, losses, seconds, skipped, stopped, start, done = [], [], [], [], None, 0, {}
        saver = None
        if cfg.save_every and getattr(cfg, "save_async", False):   # collective: a process group of its own
            # lazy: start-up: checkpoint.async_save loads only on this path
            from threefold.checkpoint.async_save import AsyncSaver
            saver = AsyncSaver()
        held, walls, restarts, stragglers = [], [], [], []
        # lazy: start-up: train.stragglers loads only on this path
        from threefold.train.stragglers import StragglerWatch, describe
        watch = StragglerWatch(pm) if pm.plan.world_size > 1 else None
        if resume is not None:
            info = threefold.load(pm, opt, resume)
            start, done = int(info["step"]), info["extra"] or {}
            losses, seconds = list(done.get("losses", [])), list(done.get("seconds", []))
            skipped, rows = list(done.get("skipped", [])), list(done.get("rows", []))
            restarts = list(done.get("restarts", []))
            source.load_state_dict(done.get("data"), start)
            if main:
                # lazy: start-up: checkpoint.files loads only on this path
                from threefold.checkpoint.files import drop_partial
                drop_partial(os.path.dirname(os.path.abspath(info["path"])))   # an interrupted save's leftovers
                print(f"threefold train: resumed from {info['path']} at step {start}", file=sys.stderr)
        log = MetricsLog(os.path.join(live_dir, "metrics.jsonl") if live_dir and main else None,
                         os.path.join(live_dir, "tensorboard") if live_dir and main else None)
        initial_val = done.get("initial_val_loss") if resume is not None else None
        if resume is None and source.val and cfg.eval_every > 0:   # where the curve starts
            initial_val = validation_loss(pm, source.val.__getitem__, len(source.val))
        tracer = NoTracer()
        if getattr(cfg, "trace", False):   # --trace takes over from THREEFOLD_TRACE
            tracer, pm._env_trace = StepTracer(pm.engine, parse_steps(cfg.trace_steps),
                                               {"workload": cfg.spec or "embedded GPT"}), None
        progress.training(start)
        try:
            for step in range(start, cfg.steps):
                walls.append(time.perf_counter())
                lr = schedule(step)
                set_lr(opt, lr)
                *inputs, target = source.next()
                t0 = time.perf_counter()
                with tracer.step(step + 1):      # --trace: this step's actions, timed (runtime/trace.py)
                    opt.zero_grad()
                    loss = pm.step(*inputs, target=target if loss_fn is not None else None)
                    with tracer.span("clip grad norm"):   # also the finiteness check, agreed by every rank
                        norm = pm.clip_grad_norm_(max_norm)
                    # under fp16 an overflowing gradient is the loss scaler's to handle: its step
                    # skips the update and lowers the scale
                    bad = f"loss {loss}" if not math.isfinite(loss) else (
                        "gradient norm (inf or nan)" if not math.isfinite(norm) and not scaled else None)
                    if bad is None:
                        with tracer.span("optimizer step"):
                            opt.step()
                seconds.append(time.perf_counter() - t0)
                losses.append(loss)
                slow = watch.end_step(step + 1) if watch is not None else None
                val = validation_loss(pm, source.val.__getitem__, len(source.val)) \
                    if source.val and due(step + 1, cfg.eval_every, cfg.steps) else None
                tps = tokens_per_second(seconds, tokens_per_step)
                row = {"step": step + 1, "loss": loss, "val_loss": val, "lr": lr, "grad_norm": norm,
                       "tokens_per_s": tokens_per_step / seconds[-1], "tokens_per_s_avg": tps,
                       "model_flops_per_s": flops_per_step / seconds[-1], "step_seconds": seconds[-1],
                       "memory": memory_per_rank(pm.engine.device)}
                if scaled:
                    row["loss_scale"] = float(opt.scaler.scale)
                    if bad is None and opt.scaler.last_skipped:   # the scaler skipped this update
                        row["skipped"] = "fp16 overflow (loss scale lowered)"
                        skipped.append({"step": step + 1, "reason": row["skipped"]})
                if bad is not None and cfg.skip_nonfinite:
                    row["skipped"] = f"non-finite {bad} (--skip-nonfinite)"
                    skipped.append({"step": step + 1, "reason": row["skipped"]})
                if slow is not None:     # reported, never stopped (train/stragglers.py)
                    row["straggler"] = slow
                    stragglers.append(slow)
                    if main:
                        print(f"threefold train: {describe(slow)}", file=sys.stderr)
                if restart is not None and step == start:   # the first step after a restart
                    row["restart"] = restart_record(restart, start, str(pm.plan))
                    restarts.append(row["restart"])
                    if main:
                        lost = row["restart"]["steps_lost"]
                        print(f"threefold train: restarted at step {start} on plan {pm.plan} (was "
                              f"{restart['old_plan']}); {row['restart']['seconds_lost']:.1f} s and "
                              f"{'an unknown number of' if lost is None else lost} step(s) lost", file=sys.stderr)
                rows.append(row)
                log.write(row)
                progress.update(loss, tps, val)
                if bad is not None and not cfg.skip_nonfinite:
                    stopped = (step + 1, bad)
                    break
                if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
                    extra = {"losses": losses, "seconds": seconds, "skipped": skipped, "rows": rows,
                             "data": source.state_dict(), "initial_val_loss": initial_val,
                             "generate": source.generate_info, "restarts": restarts}
                    t_save = time.perf_counter()
                    if saver is not None:   # the loop waits only for the copy to host memory
                        saver.save(pm, opt, ckpt_dir, step=step + 1, keep=2, extra=extra, run=run)
                    else:
                        threefold.save(pm, opt, ckpt_dir, step=step + 1, keep=2, extra=extra, run=run)
                    held.append({"step": step + 1, "held_s": time.perf_counter() - t_save})
            walls.append(time.perf_counter())
            if saver is not None:
                saver.wait()      # the last checkpoint is complete before the run says it is done
        finally:
            log.close()
    trace = tracer.finish()   # collective: clocks aligned, merged on rank 0
    sample = None
    if stopped is None and getattr(cfg, "sample_tokens", 0) > 0 and source.tokenizer is not None:
        sample = final_sample(pm, model, source, cfg)
    return {"losses": losses, "seconds": seconds, "tokens_per_step": tokens_per_step, "skipped": skipped,
            "stopped": stopped, "rows": rows, "flops_per_step": flops_per_step, "sample": sample,
            "initial_val_loss": initial_val, "trace": trace, "restarts": restarts,
            "checkpoints_held": held, "step_walls": walls, "stragglers": stragglers}


def restart_record(restart: dict, start: int, new_plan: str) -> dict:
    """What the metrics keep of a restart: where it resumed, the plans, what it cost (the
    wall time from the failure to this first step, the steps done again)."""
    now = time.time()
    return {"step": start, "old_plan": restart["old_plan"], "new_plan": new_plan,
            "old_world": restart.get("old_world"), "new_world": restart.get("new_world"),
            "reached_step": restart.get("reached_step"),
            # unknown (None) where no record of the failed attempt's last step reached us (torchrun)
            "steps_lost": None if restart.get("reached_step") is None else max(0, int(restart["reached_step"]) - start),
            "seconds_lost": now - restart["failed_at"], "failed_at": restart["failed_at"], "resumed_at": now,
            "cause": restart.get("cause")}


def final_sample(pm, model: torch.nn.Module, source: Source, cfg) -> str | None:
    """Text from the trained weights (made whole on rank 0); None on other ranks."""
    # lazy: start-up: train.generate loads only on this path
    from threefold.train.generate import gather_full_state, load_into, sample
    full = gather_full_state(pm)       # collective: every rank sends its pieces
    if full is None:
        return None
    load_into(model, full)
    tok = source.tokenizer
    context = (source.generate_info or {}).get("context") or 1024
    ids = sample(model, tok.encode(cfg.sample_prompt), cfg.sample_tokens, context,
                 temperature=getattr(cfg, "sample_temperature", 0.8), top_k=None, seed=cfg.seed)
    return tok.decode(ids)
