"""The restore protocol with a slow rank 0, outside Ray: what tests/test_restore.py measures.

`python -m support.restore_check MODE RUN_DIR OUT` (from tests/) runs as one of 2 gloo ranks
(torchrun's environment variables) whose default group times out after COLLECTIVE_TIMEOUT_S,
as `fault.collective_timeout_s` sets it for a run; rank 0 takes SLOW_S longer than that to
choose the checkpoint (as it does downloading and hashing many GB).

- `restore`: `restore_group`, as the worker calls it: both ranks must restore the same
  checkpoint, and the default group must still work afterwards.
- `default-group`: the protocol it replaced (the choice broadcast in the default group):
  rank 1 must time out, which is what aborts NCCL ranks on a GPU cluster.

Each rank writes what it saw to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain_lm import checkpoints
from raytrain_lm.model import GPT, GPTShape
from raytrain_lm.trainer.checkpointing import restore
from raytrain_lm.trainer.distributed.collectives import pin_gloo_interface

COLLECTIVE_TIMEOUT_S = 3.0
SLOW_S = 7.0
STEP = 5
CPU = torch.device("cpu")


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = GPT(GPTShape(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _write_checkpoint(run_dir: Path) -> None:
    model, optimizer = _model_and_optimizer(seed=1)
    local = Path(tempfile.mkdtemp())
    state = checkpoints.TrainState(step=STEP, tokens=STEP * 64, position=STEP * 4, strategy="ddp")
    checkpoints.save_checkpoint(local, model, optimizer, state, {})
    checkpoints.upload_checkpoint(local, str(run_dir / f"checkpoint_{STEP:06d}"), 30.0)


def main(mode: str, run_dir: Path, out: Path) -> None:
    rank = int(os.environ["RANK"])
    interface = pin_gloo_interface("127.0.0.1")  # every group below binds to it
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # Built before the ranks meet: AdamW's first construction imports torch._dynamo, which under
    # CI's load took rank 1 seconds, so its broadcast began late enough not to time out.
    model, optimizer = _model_and_optimizer(seed=2)  # other weights than the checkpoint's
    if rank == 0:
        _write_checkpoint(run_dir)
    else:  # not a barrier: on a loaded machine the write alone outlasts the 3-second timeout
        marker = run_dir / f"checkpoint_{STEP:06d}" / checkpoints.MARKER_FILE
        deadline = time.time() + 60
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
    seen: dict = {"interface": interface}
    started = time.time()
    if mode == "restore":
        choose = restore.restore_newest

        def slowly(*args, **kwargs):
            time.sleep(SLOW_S)
            return choose(*args, **kwargs)

        restore.restore_newest = slowly
        location, state = restore.restore_group(
            [str(p) for p in sorted(run_dir.iterdir())], model, optimizer, CPU, rank, "ddp", 60.0
        )
        expected, _ = _model_and_optimizer(seed=1)
        pairs = zip(model.state_dict().values(), expected.state_dict().values(), strict=True)
        same = all(torch.equal(a, b) for a, b in pairs)
        total = torch.tensor([1.0])
        dist.all_reduce(total)  # the training group is as healthy as before
        seen |= {"location": Path(location).name, "step": state.step, "weights_restored": same,
                 "group_after": total.item()}  # fmt: skip
    else:
        box = [None]
        try:
            if rank == 0:
                time.sleep(SLOW_S)
                box[0] = "checkpoint"
            dist.broadcast_object_list(box, src=0)
            seen["received"] = box[0]
        except Exception as exc:
            seen["error"] = f"{type(exc).__name__}: {exc}"[:500]
    seen["waited_s"] = round(time.time() - started, 1)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if mode == "restore":
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # a timed-out gloo group may hang on teardown


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
