"""`train_loop_per_worker`: restore first, then step, then report (Ray's own pattern).

This is the only module that calls `ray.train.*`. Each worker gets the whole run config but
hands each component only its own section.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from raytrain_lm.config import RunConfig, to_yaml
from raytrain_lm.data.ledger import discard_after
from raytrain_lm.data.manifest import Manifest
from raytrain_lm.data.order import SequenceOrder
from raytrain_lm.data.stream import WorkerSlice, stream_train_batches, validation_batches
from raytrain_lm.model import GPT, GPTShape
from raytrain_lm.tokenization import load_tokenizer
from raytrain_lm.tracking import MLflowTracker, NullTracker, Tracker
from raytrain_lm.trainer import faults, hardware
from raytrain_lm.trainer.callbacks import alive_node_ids
from raytrain_lm.trainer.checkpoint import (
    TrainState,
    is_complete,
    latest_complete_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    read_state,
    save_checkpoint,
)
from raytrain_lm.trainer.goodput import (
    Heartbeat,
    append_event,
    close_previous_segment,
    read_events,
    summarize,
)
from raytrain_lm.trainer.plan import BatchPlan, learning_rate
from raytrain_lm.trainer.progress import ProgressBar
from raytrain_lm.trainer.watchdog import StepWatchdog

HEARTBEAT_EVERY_S = 0.5


def model_shape(cfg: RunConfig, tokenizer_vocab: int) -> GPTShape:
    m = cfg.model
    return GPTShape(
        vocab_size=m.vocab_size or tokenizer_vocab,
        block_size=m.block_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        dropout=m.dropout,
        bias=m.bias,
    )


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    cfg: RunConfig,
    data_dir: str,
    manifest: Manifest,
    rank: int,
    world: int,
    device: torch.device,
    bf16: bool,
) -> float:
    """Mean token loss over the fixed validation set; identical whatever the world size."""
    model.eval()
    total, count = 0.0, 0
    batch = cfg.training.micro_batch_size or max(1, cfg.training.global_batch_size // world)
    for tokens in validation_batches(
        data_dir, manifest, cfg.model.block_size, cfg.training.eval_sequences, rank, world, batch
    ):
        t = torch.from_numpy(tokens.astype(np.int64)).to(device)
        with hardware.autocast(device, bf16):
            _, loss = model(t[:, :-1], t[:, 1:])
        total += float(loss) * t.shape[0]
        count += t.shape[0]
    model.train()
    total, count = _all_reduce_sum([total, float(count)], device)
    return total / max(count, 1.0)


def _node_accelerator_type() -> str:
    """This worker's node's accelerator type from its Ray resources (`cpu` if none)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            for name in node.get("Resources", {}):
                if name.startswith("accelerator_type:"):
                    return name.split(":", 1)[1]
    return "cpu"


def _restore(checkpoint, run_dir, model, optimizer, device, expect_checkpoint: bool) -> TrainState:
    """Loads the newest complete checkpoint: the one Ray Train offers, or a newer complete one
    in the run directory (written and uploaded, but the group failed before Ray registered
    it; every rank had finished that step's all-reduce, so it is as valid as any other)."""
    offered = None
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            if is_complete(directory):
                offered = (read_state(directory).step, directory)
            else:
                print(f"[raytrain-lm] checkpoint {directory} is incomplete; not loading it")
    on_disk = latest_complete_checkpoint(run_dir) if run_dir else None
    if on_disk is not None and (offered is None or read_state(on_disk).step > offered[0]):
        if offered is not None or checkpoint is not None:
            print(f"[raytrain-lm] restoring the newer complete checkpoint {on_disk.name}")
        return load_checkpoint(on_disk, model, optimizer, device)
    if offered is not None:
        with checkpoint.as_directory() as directory:
            return load_checkpoint(directory, model, optimizer, device)
    if expect_checkpoint:
        raise RuntimeError(
            "this run has checkpoints but none is complete; refusing to start from step 0 "
            "(remove the run directory to start afresh)"
        )
    return TrainState()


def _step_seed(seed: int, step: int, rank: int) -> int:
    # Dropout noise is a function of (seed, step, rank), so a resumed run draws the same noise.
    return (seed * 1_000_003 + step * 7_919 + rank) % (1 << 62)


def _quiet_ray_train_info_logs() -> None:
    # Ray Train logs every report and checkpoint at INFO from loggers named by file path,
    # which LoggingConfig does not reach; our progress line already says the same.
    import logging

    from ray.train.v2._internal.execution import context, storage

    for module in (context, storage):
        logging.getLogger(module.__file__).setLevel(logging.WARNING)
        logging.getLogger(module.__name__).setLevel(logging.WARNING)


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    t_start = time.time()
    _quiet_ray_train_info_logs()
    cfg = RunConfig.model_validate(payload["config"])
    data_dir: str = payload["data_dir"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    hardware.configure_device(device)
    bf16 = hardware.use_bf16(device, cfg.training.precision)

    manifest = Manifest.load(data_dir)
    tokenizer_json = load_tokenizer(data_dir).to_json()
    plan = BatchPlan.derive(cfg.training, world)

    torch.manual_seed(cfg.training.seed)
    model = GPT(model_shape(cfg, manifest.vocab_size)).to(device)
    optimizer = hardware.build_adamw(
        model.optimizer_groups(cfg.optim.weight_decay),
        cfg.optim.lr,
        (cfg.optim.beta1, cfg.optim.beta2),
        device,
    )

    # --- restore -------------------------------------------------------------------------
    run_dir: str | None = payload.get("run_dir")
    fault = faults.parse(payload.get("fault"))
    state = _restore(
        ray.train.get_checkpoint(),
        run_dir,
        model,
        optimizer,
        device,
        bool(payload.get("expect_checkpoint")),
    )
    restored_step = state.step
    if rank == 0 and cfg.training.ledger and run_dir:
        discard_after(run_dir, state.step)
    tracker: Tracker = NullTracker()
    if rank == 0 and payload.get("tracking_uri") and payload.get("mlflow_run_id"):
        tracker = MLflowTracker(payload["tracking_uri"], payload["mlflow_run_id"])
    price = cfg.fault.price_per_hour
    my_type = _node_accelerator_type() if price else "cpu"
    group_price = _all_reduce_sum([price.get(my_type, price.get("default", 0.0))], device)[0]
    segment = uuid.uuid4().hex[:12]
    events: list[dict[str, Any]] = []
    if rank == 0 and run_dir:
        close_previous_segment(run_dir)
        events = read_events(run_dir)
        events.append(
            append_event(
                run_dir,
                "segment_start",
                segment=segment,
                t_start=t_start,
                t_restored=time.time(),
                restored_step=state.step,
                world_size=world,
                accumulation=plan.accumulation,
                price_per_hour=group_price,
                nodes=sorted(alive_node_ids()),  # lets a failure tell a lost node (callbacks.py)
            )
        )
    if rank == 0:
        origin = (
            f"resumed at step {state.step} ({state.tokens:,} tokens)" if state.step else "started"
        )
        print(
            f"[raytrain-lm] {origin}; world size {world}, micro-batch {plan.micro_batch}, "
            f"accumulation {plan.accumulation}, global batch {plan.global_batch}",
            file=sys.__stdout__,
            flush=True,
        )
    tracker.log_metrics(
        {"world_size": world, "accumulation_steps": plan.accumulation}, step=state.step
    )

    raw_model = model
    if cfg.training.compile:
        model = torch.compile(model)
    model = ray.train.torch.prepare_model(model, move_to_device=False)
    is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)

    # --- data ------------------------------------------------------------------------------
    seq_len = cfg.model.block_size
    order = SequenceOrder(
        [s.tokens for s in manifest.splits["train"].shards],
        seq_len,
        cfg.data.seed,
        cfg.data.shuffle_window_shards,
    )
    end_step = min(cfg.training.max_steps, cfg.training.stop_after_step or cfg.training.max_steps)
    part = WorkerSlice(rank, world, plan.global_batch)
    if state.position != state.step * plan.global_batch:
        raise RuntimeError(f"inconsistent checkpoint: position {state.position}, step {state.step}")
    batches = stream_train_batches(
        data_dir,
        manifest,
        order,
        part,
        plan.micro_batch,
        state.step,
        end_step,
        read_cpus=payload.get("read_cpus", 0.5),
    )

    # --- step --------------------------------------------------------------------------------
    decay = cfg.optim.decay_steps or cfg.training.max_steps
    tokens_per_step = plan.global_batch * seq_len
    flops_per_token = raw_model.flops_per_token()
    progress = None
    if rank == 0 and cfg.training.progress:
        progress = ProgressBar(end_step, state.step, cfg.training.log_every)
    watchdog = StepWatchdog(cfg.fault.step_timeout_s).start()
    ledger: list[np.ndarray] = []
    last_report = {"step": state.step, "tokens": state.tokens}
    train_loss = float("nan")
    timed_tokens, timed_seconds, warmup_steps = 0, 0.0, state.step + 3
    step_seconds, last_beat, last_preemption_check = 0.0, 0.0, time.monotonic()
    preempted = False

    def beat(force: bool = False) -> None:
        nonlocal last_beat
        if rank == 0 and run_dir and (force or time.monotonic() - last_beat > HEARTBEAT_EVERY_S):
            Heartbeat(segment, state.step, time.time(), step_seconds).write(run_dir)
            last_beat = time.monotonic()

    def report_checkpoint(extra: dict[str, Any] | None = None) -> None:
        nonlocal last_report, ledger
        # Metrics up to this step are stored before the checkpoint exists: a run resumed from
        # it never logs those steps again, and the worker may be stopped right after the
        # report (a resize, or Tune pausing or cloning a trial).
        tracker.flush()
        state.world_size = world
        report = {
            "step": state.step,
            "tokens": state.tokens,
            "train_loss": train_loss,
            "val_loss": state.val_loss,
            "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else tokens_per_s,
            **(extra or {}),
        }
        _report_with_checkpoint(
            report,
            state,
            raw_model,
            optimizer,
            rank,
            tokenizer_json,
            to_yaml(cfg),
            ledger,
            run_dir,
            last_report,
            fault,
        )
        if rank == 0 and run_dir:
            prune_checkpoints(run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best)
        last_report = {"step": state.step, "tokens": state.tokens}
        ledger = []
        watchdog.beat()

    tick = time.perf_counter()
    while state.step < end_step:
        lr = learning_rate(
            state.step, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, decay
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(_step_seed(cfg.training.seed, state.step, rank))
        loss_sum = torch.zeros((), device=device)
        data_wait = 0.0
        for micro in range(plan.accumulation):
            waited = time.perf_counter()
            positions, tokens = next(batches)
            data_wait += time.perf_counter() - waited
            if cfg.training.ledger:
                ledger.append(positions.copy())  # a view would pin its Ray Data block
            t = torch.from_numpy(tokens.astype(np.int64)).to(device, non_blocking=True)
            sync = contextlib.nullcontext()
            if is_ddp and micro < plan.accumulation - 1:
                sync = model.no_sync()  # all-reduce gradients once, on the last micro-batch
            with sync:
                with hardware.autocast(device, bf16):
                    _, loss = model(t[:, :-1], t[:, 1:])
                (loss / plan.accumulation).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            raw_model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens += tokens_per_step
        state.position += plan.global_batch
        faults.pace(fault, tick)

        # Rank 0's clock decides when to ask about preemption; the flag rides on the loss
        # all-reduce so every rank makes the (collective) call at the same step.
        ask = rank == 0 and time.monotonic() - last_preemption_check > cfg.fault.preemption_check_s
        loss_total, asks = _all_reduce_sum(
            [float(loss_sum) / plan.accumulation, float(ask)], device
        )
        train_loss = loss_total / world
        now = time.perf_counter()
        step_time, tick = now - tick, now
        step_seconds += step_time
        watchdog.beat()
        tokens_per_s = tokens_per_step / step_time
        if state.step > warmup_steps:  # the first steps pay for start-up and data warm-up
            timed_tokens += tokens_per_step
            timed_seconds += step_time
        if state.step == restored_step + 1 and rank == 0 and run_dir:
            events.append(append_event(run_dir, "first_step", segment=segment, step=state.step))
        beat()
        metrics = {
            "train/loss": train_loss,
            "train/lr": lr,
            "train/grad_norm": float(grad_norm),
            "perf/tokens_per_s": tokens_per_s,
            "perf/mfu": hardware.mfu(flops_per_token, tokens_per_s / world, device),
            "perf/step_time_s": step_time,
            "perf/data_wait_fraction": data_wait / step_time,
            "progress/tokens": state.tokens,
        }
        last_step = state.step == end_step
        if rank == 0 and events and (state.step % cfg.training.log_every == 0 or last_step):
            live = summarize(events, time.time())
            live.step_s += step_seconds
            metrics.update(live.metrics(state.tokens, tokens_per_step))
        if state.step % cfg.training.eval_every == 0 or last_step:
            state.val_loss = evaluate(raw_model, cfg, data_dir, manifest, rank, world, device, bf16)
            state.val_step = state.step
            metrics["val/loss"] = state.val_loss
            watchdog.beat()
            tick = time.perf_counter()  # evaluation time is not step time
        tracker.log_metrics(metrics, step=state.step)
        if progress is not None:
            progress.update(state.step, metrics, force="val/loss" in metrics)

        if asks and not last_step:
            last_preemption_check = time.monotonic()
            info = ray.train.get_preemption_info()
            if info is not None and cfg.fault.checkpoint_on_preemption:
                # A node of ours is being drained: checkpoint now, then end this worker
                # group so the driver restarts at once on the nodes that stay. Steps taken
                # while waiting for the node to vanish would only be recomputed.
                preempted = True
                if rank == 0 and run_dir:
                    events.append(
                        append_event(
                            run_dir,
                            "preemption",
                            step=state.step,
                            deadline_ms=info.deadline_ms,
                            ranks=sorted(info.preempted_ranks),
                        )
                    )
                    print(
                        f"[raytrain-lm] preemption notice for ranks {sorted(info.preempted_ranks)}"
                        f"; just-in-time checkpoint at step {state.step}, then resizing",
                        file=sys.__stdout__,
                        flush=True,
                    )
                report_checkpoint({"preempted": True})
                tick = time.perf_counter()
                break
        if state.step % cfg.checkpoint.every_steps == 0 or last_step:
            report_checkpoint()
            tick = time.perf_counter()
    beat(force=True)
    watchdog.stop()
    tracker.flush()
    if preempted and rank == 0:
        print("[raytrain-lm] worker group ended for preemption", file=sys.__stdout__, flush=True)


def _report_with_checkpoint(
    report,
    state,
    model,
    optimizer,
    rank,
    tokenizer_json,
    config_yaml,
    ledger,
    run_dir,
    previous,
    fault=None,
) -> None:
    import ray.train

    if ledger and run_dir:
        # Positions consumed since the previous checkpoint, one file per rank and interval: a
        # restart from step k discards files starting at or after k (see data/ledger.py).
        folder = Path(run_dir) / "ledger"
        folder.mkdir(parents=True, exist_ok=True)
        np.save(
            folder / f"steps-{previous['step']:09d}-{state.step:09d}-rank{rank}.npy",
            np.concatenate(ledger),
        )
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            save_checkpoint(
                Path(tmp),
                model,
                optimizer,
                state,
                tokenizer_json,
                config_yaml,
                partially_written=lambda: faults.maybe_fire(
                    fault, "kill-in-checkpoint", state.step, rank, run_dir or tmp
                ),
            )
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(report, checkpoint=checkpoint)
    if run_dir:  # where the fault's fired-once marker lives
        faults.maybe_fire(fault, "kill-after-checkpoint", state.step, rank, run_dir)
