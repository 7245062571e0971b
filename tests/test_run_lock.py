"""One run per run directory (run_lock.py): a second process started on a directory a live run holds refuses in one
line naming the holder; a lock left by a killed process is taken over, with a line saying so. The module's own
behaviour with forked holders (fast), then real CLI runs racing on one directory."""

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import train
from conftest import REPO_ROOT, read_jsonl, tiny_run_overrides
from persistence import checkpoint, run_lock
from persistence.run_lock import LOCK_FILE, RunLock
from utils import UserError

HOST = socket.gethostname()
FORK = multiprocessing.get_context("fork")  # the child has this process's modules already: no second start-up


def hold(run_dir: Path, locked, release) -> None:
    """A child process's body: lock run_dir, say so, and keep it until told to release it."""
    lock = RunLock(run_dir)
    lock.acquire()
    locked.set()
    release.wait(60)
    lock.release()


def start_holder(run_dir: Path):
    """(a forked process holding run_dir's lock, the event that makes it release and exit)."""
    locked, release = FORK.Event(), FORK.Event()
    child = FORK.Process(target=hold, args=(run_dir, locked, release))
    child.start()
    assert locked.wait(30), "the child never took the lock"
    return child, release


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    child = FORK.Process(target=lambda: None)
    child.start()
    child.join()
    return child.pid


def refusal(run_dir: Path) -> str:
    with pytest.raises(UserError) as error:
        RunLock(run_dir).acquire()
    return str(error.value)


def assert_names_holder(message: str, run_dir: Path, pid: int) -> None:
    assert "\n" not in message
    assert message.startswith(f"local_run_dir={run_dir} is in use by another run: pid {pid} on {HOST}, started 20")
    assert "wait for it to end, or stop it, or choose another local_run_dir" in message


def holder_in_file(run_dir: Path) -> dict:
    return json.loads((run_dir / LOCK_FILE).read_text())


def test_a_held_directory_is_refused_in_one_line_until_its_holder_releases_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    child, release = start_holder(run_dir)
    try:
        assert_names_holder(refusal(run_dir), run_dir, child.pid)
        assert holder_in_file(run_dir)["pid"] == child.pid  # the refusal left the holder's file alone
    finally:
        release.set()
        child.join(30)
    assert child.exitcode == 0 and not (run_dir / LOCK_FILE).exists()  # a clean release deletes the file
    with RunLock(run_dir):
        assert holder_in_file(run_dir) == holder_in_file(run_dir) | {"pid": os.getpid(), "host": HOST}
        # within one process too: a second lock on the directory is refused while the first is held
        assert_names_holder(refusal(run_dir), run_dir, os.getpid())
    assert not (run_dir / LOCK_FILE).exists()
    with RunLock(run_dir):  # released in-process: free again
        pass
    assert "taking over" not in capsys.readouterr().out


def test_the_lock_of_a_killed_holder_is_taken_over_with_a_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    child, _ = start_holder(run_dir)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert holder_in_file(run_dir)["pid"] == child.pid  # left behind, naming the dead holder
    with RunLock(run_dir):
        assert holder_in_file(run_dir)["pid"] == os.getpid()
    taking_over = f"run directory lock: taking over from pid {child.pid} on {HOST} (no longer running)"
    assert capsys.readouterr().out == taking_over + "\n"


def test_a_stale_lock_file_naming_a_dead_pid_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid = dead_pid()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": HOST, "started": time.time() - 3600}))
    with RunLock(run_dir):
        assert holder_in_file(run_dir)["pid"] == os.getpid()
    assert f"taking over from pid {pid} on {HOST} (no longer running)" in capsys.readouterr().out


def test_without_flock_the_lock_file_is_the_lock(tmp_path, capsys, monkeypatch):
    """A file system that refuses flock (ENOLCK: NFS without a lock service): the lock file, linked into place,
    checked by pid on this host; another host's holder cannot be checked, so the refusal says what to delete."""
    run_dir = tmp_path / "run"
    child, release = start_holder(tmp_path / "elsewhere")  # a live process on this host, to be named as a holder

    def no_flock(fd, operation):
        raise OSError(run_lock.errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    try:
        with RunLock(run_dir):
            assert holder_in_file(run_dir)["pid"] == os.getpid()
            message = refusal(run_dir)
            assert_names_holder(message, run_dir, os.getpid())
            assert message.endswith(f"; if that run has ended, delete {run_dir / LOCK_FILE}")
        assert not (run_dir / LOCK_FILE).exists()
        assert "does not support flock (No locks available)" in capsys.readouterr().out

        lock_file = run_dir / LOCK_FILE
        for pid, host in ((child.pid, HOST), (dead_pid(), "another-host")):  # alive here; unknown elsewhere
            lock_file.write_text(json.dumps({"pid": pid, "host": host, "started": time.time()}))
            assert f"pid {pid} on {host}, started 20" in refusal(run_dir)
            assert holder_in_file(run_dir)["pid"] == pid
        pid = dead_pid()
        lock_file.write_text(json.dumps({"pid": pid, "host": HOST, "started": time.time()}))
        with RunLock(run_dir):
            assert holder_in_file(run_dir)["pid"] == os.getpid()
        assert f"taking over from pid {pid} on {HOST} (no longer running)" in capsys.readouterr().out
        assert sorted(p.name for p in run_dir.iterdir()) == []  # no temporary file left either
    finally:
        release.set()
        child.join(30)


def test_prepare_run_dir_locks_before_it_reads_or_clears_anything(tmp_path, make_config):
    """resume_from=auto on a directory without a checkpoint clears its logs: never those of a run that holds it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 8}\n')
    child, release = start_holder(run_dir)
    try:
        with pytest.raises(UserError, match=f"is in use by another run: pid {child.pid} on "):
            train.prepare_run_dir(make_config("resume_from=auto"))
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 8}\n' and not (run_dir / "config.yaml").exists()
    finally:
        release.set()
        child.join(30)
    train.prepare_run_dir(make_config("resume_from=auto"))  # free: a fresh start, which clears the old logs
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / LOCK_FILE).exists()


def test_run_releases_the_lock_when_it_fails_and_dry_runs_take_none(tmp_path, pairs_file, make_config):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match="does not exist"):  # fails after prepare_run_dir took the lock
        train.run(make_config(f"resume_from={tmp_path / 'nope'}"))
    assert (run_dir / "config.yaml").exists() and not (run_dir / LOCK_FILE).exists()
    with RunLock(run_dir):  # free in this process
        pass

    child, release = start_holder(run_dir)
    try:
        train.main([*tiny_run_overrides(tmp_path, pairs_file), "dry_run=true", "resume_from=auto"])  # no SystemExit
        assert holder_in_file(run_dir)["pid"] == child.pid
    finally:
        release.set()
        child.join(30)


# -------------------------------------------------------------------------------------------------------------
# Real CLI runs racing on one directory

GATE = '''
    """Pauses the run at its GATE_STEP-th training step until GATE_DIR/go exists; GATE_DIR/paused holds its pid."""
    import os, pathlib, time
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    steps = 0

    def before_step(optimizer, args, kwargs):
        global steps
        steps += 1
        gate = pathlib.Path(os.environ["GATE_DIR"])
        if steps == int(os.environ["GATE_STEP"]) and os.environ.get("RANK", "0") == "0":
            (gate / "paused.tmp").write_text(str(os.getpid()))
            os.replace(gate / "paused.tmp", gate / "paused")  # whole or absent
            deadline = time.time() + 120
            while not (gate / "go").exists() and time.time() < deadline:
                time.sleep(0.05)

    register_optimizer_step_pre_hook(before_step)
'''


def command(tmp_path: Path, pairs_file: Path, *overrides: str) -> list[str]:
    """train.py's arguments for the tiny run (5 steps of 8, evals and checkpoints at 16 and 32 examples, LATEST at
    40), resumable."""
    return [*tiny_run_overrides(tmp_path, pairs_file), "resume_from=auto", *overrides]


def start_cli(args: list[str], tmp_path: Path, name: str, env_extra: dict) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env_extra}
    with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
        script = [sys.executable, str(REPO_ROOT / "train.py")]
        return subprocess.Popen([*script, *args], cwd=REPO_ROOT, env=env, stdout=out, stderr=err)


def wait_paused(process: subprocess.Popen, gate: Path, tmp_path: Path) -> int:
    """The pid of the paused rank 0, once the run stands at its gate."""
    deadline = time.time() + 180
    while not (gate / "paused").exists():
        assert process.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
        assert time.time() < deadline, "the first run never reached its gate"
        time.sleep(0.1)
    return int((gate / "paused").read_text())


def assert_complete_run(run_dir: Path) -> None:
    """metrics.jsonl whole, each train step and eval once, in order; LATEST and step-N complete; the lock gone."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if "loss/train" in r] == [8, 16, 24, 32, 40]
    assert [r["step"] for r in metrics if "loss/eval" in r] == [0, 16, 32, 40]
    for name in ("step-16", "step-32", "LATEST"):
        assert checkpoint.describe(run_dir / name) is not None, name
    assert checkpoint.newest(run_dir) == run_dir / "LATEST"
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.parametrize(
    "trainer",
    ["BasicTrainer", pytest.param("FSDPTrainer", marks=pytest.mark.slow)],
)
def test_a_second_run_on_a_busy_directory_is_refused_and_the_first_finishes_intact(
    tmp_path, pairs_file, run_main, trainer
):
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    extra = ["trainer=FSDPTrainer", "nproc=2", "distributed_timeout_secs=300"] if trainer == "FSDPTrainer" else []
    gate_env = {"PYTHONPATH": str(gate), "GATE_DIR": str(gate), "GATE_STEP": "3"}
    (gate / "sitecustomize.py").write_text(textwrap.dedent(GATE))
    first = start_cli(command(tmp_path, pairs_file, *extra), tmp_path, "first", gate_env)
    try:
        holder = wait_paused(first, gate, tmp_path)  # after step 2: its eval and step-16 checkpoint are written
        if trainer == "BasicTrainer":
            assert holder == first.pid
        before = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "config.yaml")}

        # the scheduler's retry: same directory, resume_from=auto (another seed: it would rewrite config.yaml)
        second = run_main(*command(tmp_path, pairs_file, *extra, "seed=1"))
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.count("error: ") == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: local_run_dir={run_dir} is in use by another run: pid {holder} on {HOST}, ")
        assert line.endswith("wait for it to end, or stop it, or choose another local_run_dir")
        assert "resume_from=auto:" not in second.stdout  # refused before it looked for a checkpoint
        assert {name: (run_dir / name).read_text() for name in before} == before
        assert first.poll() is None
    finally:
        (gate / "go").touch()
        first.wait(300)
    assert first.returncode == 0, (tmp_path / "first.err").read_text()[-3000:]
    assert_complete_run(run_dir)


def test_a_run_killed_mid_way_is_taken_over_by_the_next(tmp_path, pairs_file, run_main):
    run_dir = tmp_path / "run"
    faults = {"PYTHONPATH": str(Path(__file__).parent / "faults"), "FAULT": "step:3"}  # SIGKILL in the third step
    killed = start_cli(command(tmp_path, pairs_file), tmp_path, "killed", faults)
    assert killed.wait(300) == -signal.SIGKILL, (tmp_path / "killed.err").read_text()[-3000:]
    assert holder_in_file(run_dir)["pid"] == killed.pid  # the killed run's lock file is left behind

    result = run_main(*command(tmp_path, pairs_file))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    taking_over = f"run directory lock: taking over from pid {killed.pid} on {HOST} (no longer running)"
    assert lines.count(taking_over) == 1
    assert lines.index(taking_over) < lines.index(f"resume_from=auto: continuing from {run_dir / 'step-16'}")
    assert_complete_run(run_dir)
