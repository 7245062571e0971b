"""Training steps the host does not wait for (sync_free_steps, training/device_steps.py): the same numbers as the
synchronised step, a non-finite step skipped on the device, and no host sync inside the step."""

import collections
import inspect
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, build_trainer

# the Tensor methods that bring a value to the host (on a GPU: wait for the device)
TO_HOST = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def run_steps(trainer, n: int, nan_at: int | None = None) -> list[dict]:
    """n training steps, as the loop runs them; step `nan_at` gets a NaN gradient. Each step's metrics, resolved."""
    finished = []
    parameter = next(trainer.policy.parameters())
    for step, indices in enumerate(trainer.data.schedule[:n]):
        handle = parameter.register_hook(lambda grad: grad * float("nan")) if step == nan_at else None
        metrics = trainer.train_step(trainer.data.train_examples.take(indices))
        trainer.batch_counter += 1
        if handle is not None:
            handle.remove()
        finished += [metrics] if metrics is not None else []
    if trainer.deferred is not None:
        finished += [step.metrics for step in trainer.deferred.resolve()]
    return finished


@pytest.mark.parametrize("warmup", [0, 3])
def test_sync_free_steps_equal_synchronised_ones_bit_for_bit_a_nan_step_skipped(make_config, warmup):
    # float32 on the CPU: the deferred optimizer step (found_inf, a float64 learning rate tensor) gives the
    # synchronised step's metrics, weights, moments and schedule exactly; a NaN step skips the update and holds back
    # the warmup in both
    common = ("max_grad_norm=1.0", f"warmup_steps={warmup}", "max_nonfinite_steps=2")
    synced = build_trainer(make_config(*common, "sync_free_steps=false"))
    deferred = build_trainer(make_config(*common, "sync_free_steps=true", f"local_run_dir={synced.run_dir}_free"))
    assert synced.deferred is None and deferred.deferred is not None
    expected, got = run_steps(synced, 5, nan_at=1), run_steps(deferred, 5, nan_at=1)
    assert [m["nonfinite_steps"] for m in got] == [[0.0], [1.0], [0.0], [0.0], [0.0]]
    for want, have in zip(expected, got):
        for name, values in want.items():
            assert have[name] == values or all(a != a and b != b for a, b in zip(have[name], values)), name
    for a, b in zip(synced.policy.parameters(), deferred.policy.parameters()):
        assert torch.equal(a, b)
        state_a, state_b = synced.optimizer.state[a], deferred.optimizer.state[b]
        assert all(torch.equal(state_a[key], state_b[key]) for key in state_a)
    assert deferred.scheduler.last_epoch == synced.scheduler.last_epoch == 4  # 5 steps, one skipped
    assert deferred.optimizer.param_groups[0]["lr"] == synced.optimizer.param_groups[0]["lr"]


def test_the_run_stops_after_too_many_nonfinite_deferred_steps(make_config):
    from utils import UserError

    trainer = build_trainer(make_config("sync_free_steps=true", "max_nonfinite_steps=1"))
    parameter = next(trainer.policy.parameters())
    parameter.register_hook(lambda grad: grad * float("nan"))
    trainer.train_step(trainer.data.train_examples.take(trainer.data.schedule[0]))
    with pytest.raises(UserError, match=r"1 optimizer steps in a row had a non-finite .* the last at step 1"):
        trainer.steps.close_interval(True, trainer.counters(), False, None)


def host_call_sites(step) -> collections.Counter:
    """Where this repository's code calls a TO_HOST method of a tensor during step(): 'file:function' counted."""
    sites, originals = collections.Counter(), {name: getattr(torch.Tensor, name) for name in TO_HOST}

    def recording(name):
        def method(self, *args, **kwargs):
            frame = inspect.currentframe().f_back
            while frame is not None and not frame.f_code.co_filename.startswith(str(REPO_ROOT)):
                frame = frame.f_back
            if frame is not None and "/tests/" not in frame.f_code.co_filename:
                sites[f"{Path(frame.f_code.co_filename).relative_to(REPO_ROOT)}:{frame.f_code.co_name}"] += 1
            return originals[name](self, *args, **kwargs)

        return method

    try:
        for name in TO_HOST:
            setattr(torch.Tensor, name, recording(name))
        step()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return sites


# Host-side work of a step, on tensors that live on the host (a GPU never waits for them): laying out the batch from
# lengths (core/layouts.py) and the cached reference's lookup. Anything else is a sync on a GPU.
HOST_SITES = {"core/layouts.py:pack", "core/layouts.py:scored_fields"}


def test_a_sync_free_step_brings_nothing_to_the_host(make_config):
    # the listed call sites of .item(), .tolist(), .cpu(), bool(tensor) ... during one deferred step are all host-side
    # layout work; the synchronised step's one transfer (trainers.on_host) is what a sync looks like here
    trainer = build_trainer(make_config("sync_free_steps=true"))
    examples = trainer.data.train_examples.take(trainer.data.schedule[0])
    sites = host_call_sites(lambda: trainer.train_step(examples))
    assert set(sites) <= HOST_SITES, sites
    synced = build_trainer(make_config("sync_free_steps=false", f"local_run_dir={trainer.run_dir}_synced"))
    sites = host_call_sites(lambda: synced.train_step(examples))
    assert set(sites) - HOST_SITES == {"trainers.py:on_host"}, sites


def test_sync_free_steps_true_refuses_what_decides_on_the_host(make_config):
    from utils import UserError

    with pytest.raises(UserError, match=r"^sync_free_steps=true: the loss keeps a running state .*; set sync_free"):
        build_trainer(make_config("sync_free_steps=true", "loss=bco_pair"))
    with pytest.raises(UserError, match=r"^sync_free_steps=true: SGD is not fused"):
        build_trainer(make_config("sync_free_steps=true", "optimizer=SGD", "+optimizer_kwargs.fused=false"))


@pytest.mark.cuda
def test_a_sync_free_step_on_cuda_never_waits_for_the_device(make_config):
    # torch's own sync detector: any host-device synchronisation inside the step raises
    trainer = build_trainer(make_config("sync_free_steps=auto", "model.fsdp_policy_mp=bfloat16"))
    assert trainer.deferred is not None
    batches = [trainer.data.train_examples.take(indices) for indices in trainer.data.schedule[:3]]
    trainer.train_step(batches[0])  # the first: compiles, allocates
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for examples in batches[1:]:
            trainer.train_step(examples)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [step.finite for step in trainer.deferred.resolve()] == [True] * 3


def test_a_sync_free_run_logs_and_resumes_as_a_synchronised_one(make_config, tmp_path):
    # the loop: steps resolved when a log interval closes (here only where an eval or checkpoint may follow, every 2
    # steps), logged as the synchronised run logs them; a resume from its checkpoint continues it exactly
    import train
    from conftest import assert_resume_matches_uninterrupted, assert_same_metrics, records

    runs = {}
    for setting in ("false", "true"):
        config = make_config(f"sync_free_steps={setting}", "minimum_log_interval_secs=1e9", "warmup_steps=2",
                             f"local_run_dir={tmp_path / setting}")  # fmt: skip
        train.run(config)
        runs[setting] = records(tmp_path / setting, "train")
    assert [r["step"] for r in runs["true"]] == [16, 32, 40]
    assert_same_metrics(runs["false"], runs["true"])
    assert_resume_matches_uninterrupted(make_config, tmp_path / "resume", "sync_free_steps=true")
