"""rounds.server: each round's policy served by a command the user names (training/policy_server.py), here the
stand-in server of tests/stand_in_server.py, whose completions are our own loop's draws from the model it loaded."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import transformers
from omegaconf import OmegaConf

import train
from configuration.checks import check_rounds
from conftest import build_trainer, policy_state
from persistence.checkpoint import export_live
from stand_in_server import completions
from test_rounds import LOWERCASE, ROUNDS, read_round, round_records
from training.policy_server import answers, identity, note_server
from utils import UserError

STAND_IN = f"{sys.executable} -m tests.stand_in_server {{model}} {{port}}"


def test_a_server_started_for_each_round_samples_the_policy_that_starts_it(make_config, tmp_path, capsys):
    # Every completion in a round's file is the one the stand-in draws from the weights that started the round (round 0:
    # the initial policy; round 1: the checkpoint that ended round 0): the served copy was that round's policy, and
    # its answers (the EOS left out of the ids, finish_reason "stop") came back as drawn. After each round the copy
    # is removed and the server's output kept.
    config = make_config(*ROUNDS, "rounds.n=2", f"rounds.server='{STAND_IN}'")
    start = build_trainer(make_config(*ROUNDS, "rounds.n=2", f"local_run_dir={tmp_path / 'start'}"))
    model, tokenizer = start.policy, start.tokenizer
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    train.run(config)
    run_dir = Path(config.local_run_dir)
    assert capsys.readouterr().out.count("sampling: the generation server http://127.0.0.1:") == 2
    round_end = round_records(run_dir)[1]["step"]
    trained = policy_state(run_dir / f"step-{round_end}")
    assert any(not value.equal(initial[name]) for name, value in trained.items())  # round 1's policy is another
    for index, state in ((0, initial), (1, trained)):
        model.load_state_dict(state)
        lines = read_round(run_dir, index)
        assert len(lines) >= 8
        for line in lines:
            request = {"prompt": line["prompt_ids"], "n": 4, "temperature": 1.0, "top_p": 0.9, "max_tokens": 8}
            assert line["completion_ids"] == [
                choice["drawn"] for choice in completions(model, tokenizer, request)["choices"]
            ]
        assert (run_dir / "rounds" / f"server-{index}.log").is_file()
        assert not (run_dir / "rounds" / f"policy-{index}").exists()


def test_the_served_copy_is_the_policys_weights_as_they_are_now(make_config, tmp_path):
    # export_live writes the live weights (not a checkpoint's) as a from_pretrained directory: after a change to
    # them, from_pretrained reads back exactly the changed values.
    trainer = build_trainer(make_config())
    for parameter in trainer.policy.parameters():
        parameter.data.add_(0.125)
    export_live(tmp_path / "copy", trainer.policy, trainer.tokenizer, trainer.topology)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    ours = trainer.policy.state_dict()
    assert all(value.equal(ours[name]) for name, value in loaded.state_dict().items())
    assert (
        transformers.AutoTokenizer.from_pretrained(tmp_path / "copy")("abc")["input_ids"]
        == trainer.tokenizer("abc")["input_ids"]
    )


def running(marker: str) -> bool:
    """Whether a process whose command line holds marker is alive."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return True
        except OSError:
            continue
    return False


def test_a_server_that_fails_to_serve_is_one_line_and_is_stopped(make_config, tmp_path):
    # A command that exits before serving: its exit code and its output's last line; one that never answers: stopped
    # (its process group killed) once rounds.server_timeout has passed; either way the policy's copy is removed.
    def fails(command: str, *extra: str) -> tuple[str, Path]:
        config = make_config(*ROUNDS, "rounds.n=1", f"rounds.server='{command}'", *extra)
        with pytest.raises(UserError) as raised:
            train.run(config)
        assert "\n" not in str(raised.value)
        rounds_dir = Path(config.local_run_dir) / "rounds"
        assert not (rounds_dir / "policy-0").exists()
        return str(raised.value), rounds_dir

    (tmp_path / "exits.py").write_text('print("no engine here")\nraise SystemExit(3)\n')
    message, rounds_dir = fails(f"{sys.executable} {tmp_path / 'exits.py'} {{model}} {{port}}")
    assert (
        message.startswith("rounds.server: `") and " exited with code 3 before serving at http://127.0.0.1:" in message
    )
    assert message.endswith(f"({rounds_dir / 'server-0.log'}: no engine here)")
    marker = uuid.uuid4().hex
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(120)\n")
    message, rounds_dir = fails(f"{sys.executable} {tmp_path / 'sleeps.py'} {{model}} {{port}} {marker}",
                                "rounds.server_timeout=2")  # fmt: skip
    assert " did not answer at http://127.0.0.1:" in message and "within 2 s (rounds.server_timeout)" in message
    assert not running(marker)


def group(pgid: int) -> list[int]:
    """The processes of process group pgid still alive (a zombie holds no memory and no port)."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(pid))
    return members


def gone(pgid: int, within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not group(pgid)


# The smallest process that serves a round's policy as a trainer does: PolicyServer entered in a thread that ends at
# once (the server is the process's, not the thread's), then nothing but waiting to be killed.
TRAINER = """
import sys, threading, time
from pathlib import Path
from training.policy_server import PolicyServer
server = PolicyServer(sys.argv[1], Path("unused"), Path(sys.argv[2]), 60)
thread = threading.Thread(target=server.__enter__)
thread.start()
thread.join()
print("serving", server.url, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads the processes from /proc")
def test_a_served_rounds_server_dies_with_its_trainer_even_one_killed_with_sigkill(tmp_path):
    # A trainer killed with SIGKILL (no handler, no finally) while its round's policy is served leaves no process of
    # the server's group, and the port answers no more. The command is a wrapper that forks rather than execs (as
    # `sh -c`, or an engine that starts workers): the shell, its listening server and its other child all die.
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("{}")  # what answers() asks for, served as a file
    listen = f"{sys.executable} -m http.server {{port}} --bind 127.0.0.1 --directory {tmp_path}"
    log = tmp_path / "server-0.log"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, f"sh -c '{listen} & sleep 600 & wait'", str(log)],
                               cwd=Path(__file__).parents[1], stdout=subprocess.PIPE, text=True)  # fmt: skip
    pgid = None
    try:
        url = next(line.split()[1] for line in trainer.stdout if line.startswith("serving "))
        pgid = json.loads(log.with_suffix(".pid").read_text())["pid"]
        time.sleep(0.5)  # the thread that started the server has ended: the server must not have
        assert answers(url) and len(group(pgid)) >= 3  # the shell, its http server and its sleep (and a watcher)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        assert gone(pgid), f"left running: {group(pgid)}"
        assert not answers(url)
    finally:
        trainer.kill()
        trainer.wait()
        if pgid is not None and group(pgid):
            os.killpg(pgid, signal.SIGKILL)


@pytest.mark.skipif(sys.platform != "linux", reason="reads the processes from /proc")
def test_a_served_round_clears_what_a_run_killed_while_serving_left(make_config, tmp_path, capsys):
    # An earlier run killed while serving round 0 left its server running (a wrapper and its child, in a session of
    # their own as the watcher starts them) named by server-0.pid, and its policy's copy; server-1.pid names a pid that
    # another process has since (its start time is not the recorded one); server-2.pid a server that has ended (its
    # watcher stopped it). The next served round kills the first group, leaves the other process alone, removes the
    # pid files and the copy, and says so in one line.
    (tmp_path / "exits.py").write_text("raise SystemExit(3)\n")
    config = make_config(*ROUNDS, "rounds.n=1", f"rounds.server='{sys.executable} {tmp_path / 'exits.py'} {{model}}"
                                                f" {{port}}'")  # fmt: skip
    rounds_dir = Path(config.local_run_dir) / "rounds"
    (rounds_dir / "policy-0").mkdir(parents=True)
    ours = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    ended = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        note_server(rounds_dir / "server-2.pid", ended.pid, "sleep 600")
        ended.kill()
        ended.wait()
        note_server(rounds_dir / "server-0.pid", ours.pid, "sh -c 'sleep 600 & wait'")
        boot, started = identity(other.pid).split()
        reused = {"pid": other.pid, "identity": f"{boot} {int(started) - 1}", "command": "an earlier server"}
        (rounds_dir / "server-1.pid").write_text(json.dumps(reused))
        while len(group(ours.pid)) < 2:  # the shell has started its child
            time.sleep(0.05)
        with pytest.raises(UserError, match=" exited with code 3 before serving"):
            train.run(config)
        assert not group(ours.pid) and ours.wait(5) == -signal.SIGKILL
        assert other.poll() is None
        assert not list(rounds_dir.glob("*.pid")) and not list(rounds_dir.glob("policy-*"))
        assert (
            f"rounds.server: an earlier run left {rounds_dir}: its server killed (process group {ours.pid}, "
            f"server-0.pid); server-1.pid removed (pid {other.pid} is another process's now: left alone); "
            "server-2.pid removed (its server had stopped); policy-0/ removed\n" in capsys.readouterr().out
        )
    finally:
        for process in (ours, other):
            if group(process.pid):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ((f"rounds.server='{STAND_IN}'",), "rounds.server=.* sets iterative rounds, but rounds.n=0 runs none$"),
        # a sweep's rounds.n=0 job (python train.py -m rounds.n=0,1 ...) keeps the reward its rounds.n=1 job needs:
        # its line names rounds.server as well
        (
            (LOWERCASE, "rounds.n=0", f"rounds.server='{STAND_IN}'"),
            f"{LOWERCASE} and rounds.server={STAND_IN} set iterative rounds, but rounds.n=0 runs none$",
        ),
        ((*ROUNDS, "rounds.server='vllm serve {model}'"), "rounds.server='vllm serve {model}' lacks {port}: the comm"),
    ],
)
def test_server_settings_that_cannot_work_are_one_line(make_config, overrides, message):
    with pytest.raises(UserError, match="^" + message.replace("{", r"\{").replace("}", r"\}")):
        make_config(*overrides)


def test_a_4bit_policy_is_refused_a_server_before_the_run(make_config):
    # QLoRA needs a GPU, so its config does not load here: the rounds' check of the loaded config is asked directly.
    config = OmegaConf.to_object(make_config(*ROUNDS, "rounds.n=1", f"rounds.server='{STAND_IN}'", "lora.enabled=true"))
    check_rounds(config)  # LoRA merged into a float base: served
    config.lora.quantize = "4bit"
    with pytest.raises(UserError, match="^rounds.server samples a round's policy written as a model, and lora.quanti"):
        check_rounds(config)
