"""Fault injection for tests/test_crash_resume.py. Python imports `sitecustomize` at start-up from PYTHONPATH, so
with this directory there, every process of a run (spawned workers too) gets these hooks. FAULT=KIND:N makes the
process of rank FAULT_RANK (default 0) stop at the Nth event of KIND:

  step       SIGKILL at the Nth training step's optimizer step, before it changes a weight (after the step's forward
             and backward passes)
  eval       SIGKILL at the Nth forward pass of an eval
  generate   SIGKILL at the Nth forward pass of a round's generation (rounds.py: sampled or greedy completions)
  reference  SIGKILL at the Nth forward pass computing reference log-probs (reference_cache.fill)
  save       SIGKILL right after the Nth torch.save (a checkpoint directory half written: a small part, or an item
             of DCP's optimizer shards)
  shards     SIGKILL right after the Nth torch.distributed.checkpoint.save of this rank (a part's shards written,
             the checkpoint's other parts not yet)
  swap       SIGKILL right after the Nth rename (e.g. between replace_dir's two renames)
  interrupt  SIGINT at the Nth training step's optimizer step, as Ctrl-C would send it: to the process, or to the
             launcher that spawned it (its parent), which passes it on to every rank
  fill       at the Nth training step's optimizer step, fill the filesystem of the directory FAULT_FILL (ballast.py),
             as another job on a shared disk may; the process goes on
"""

import os

FAULT = os.environ.get("FAULT")

if FAULT:
    import pathlib
    import signal
    import sys

    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    KIND, N = FAULT.split(":")
    counts = {}

    def event(kind: str) -> None:
        if kind != KIND or os.environ.get("RANK", "0") != os.environ.get("FAULT_RANK", "0"):
            return
        counts[kind] = counts.get(kind, 0) + 1
        if counts[kind] != int(N):
            return
        if kind == "fill":
            from ballast import fill

            fill(pathlib.Path(os.environ["FAULT_FILL"]))
        elif kind == "interrupt":
            spawned = "LOCAL_WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ
            os.kill(os.getppid() if spawned else os.getpid(), signal.SIGINT)
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    def called_from(function: str) -> bool:
        frame = sys._getframe()
        while frame is not None and frame.f_code.co_name != function:
            frame = frame.f_back
        return frame is not None

    def before_step(optimizer, args, kwargs):
        if called_from("train_step"):  # not loading a checkpoint's optimizer state, which takes an empty step
            event("step")
            event("interrupt")
            event("fill")

    register_optimizer_step_pre_hook(before_step)

    def before_forward(module, args):
        if isinstance(module, torch.nn.Embedding):
            for kind, function in (("eval", "evaluate"), ("generate", "sample"), ("reference", "fill")):
                if called_from(function):
                    event(kind)

    register_module_forward_pre_hook(before_forward)

    real_save, real_rename = torch.save, pathlib.Path.rename

    def save(*args, **kwargs):
        real_save(*args, **kwargs)
        event("save")

    def rename(self, target):
        result = real_rename(self, target)
        event("swap")
        return result

    torch.save, pathlib.Path.rename = save, rename

    import torch.distributed.checkpoint as dcp

    real_dcp_save = dcp.save

    def dcp_save(*args, **kwargs):
        result = real_dcp_save(*args, **kwargs)
        event("shards")
        return result

    dcp.save = dcp_save
