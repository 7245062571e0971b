"""A round's policy sampled by an engine the user names (rounds.server: a command holding {model} and {port}, such as
`vllm serve {model} --port {port}`). For each round the policy is written as a from_pretrained directory (its weights
as they are now; a LoRA policy's merged into its base), the command started on rank 0 in a session of its own with
its output in a log beside the round's file, its pid file beside that, and waited for until its /v1/models answers;
the round's rows are asked for through generation.server_sampling.ServerSampler (the served model checked to be that
directory, its vocabulary ours); then the server is stopped (its whole process group: SIGTERM, SIGKILL after STOP_GRACE
seconds) and the directory removed, whatever happened, before the round's reference pass and training need the memory
back. The server dies with the process that started it however that process dies (WATCHER), and what a run killed
while serving left is cleared when a served round starts (clear_leftovers). Why a server started per round, and what
it costs: docs/rounds.md#sampling-by-a-server."""

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import storage
from generation.server_sampling import ServerSampler
from modeling.distributed import Topology, free_port
from persistence.checkpoint import export_live
from utils import UserError

STOP_GRACE = 30  # seconds a server has to exit on SIGTERM before its process group is killed
POLL = 0.5  # seconds between two asks whether the server answers yet
GONE_WITHIN = 10  # seconds a leftover server is waited for once killed, so that its memory is back for the next one

# The process rank 0 starts, in a session (and process group) of its own: it starts the command in that group and
# exits with its exit code (a signal's as a shell says it, 128 + N). Once the pipe whose read end it holds reads end of
# file it stops the whole group (SIGTERM, SIGKILL after the grace, itself last): stop() closes the pipe's write end, and
# so does the kernel when the process holding it ends however it ends, SIGKILL included. Not PR_SET_PDEATHSIG on the
# command (as modeling.distributed's workers have): that fires when the *thread* that started the process ends, not
# the process; it reaches the one process it is set on, not a wrapper's children (`sh -c ...`, an engine's workers),
# while a group signal reaches every process the command starts that stays in its group; and it is Linux's alone,
# where a pipe closes on any POSIX system (macOS too). A process that leaves the group (its own setsid) escapes both.
WATCHER = """
import os, select, signal, subprocess, sys
trainer, grace, command = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM below is the server's (exec resets it there)
try:
    server = subprocess.Popen(command)
except OSError as error:
    sys.exit(f"rounds.server: could not start {command[0]}: {error.strerror or error}")
while server.poll() is None:
    if select.select([trainer], [], [], 0.2)[0]:  # readable: at end of file, the trainer is done or gone
        os.killpg(0, signal.SIGTERM)
        try:
            server.wait(grace)
        finally:
            os.killpg(0, signal.SIGKILL)  # what outlived the server (its workers, a wrapper's children), and this
sys.exit(server.returncode if server.returncode >= 0 else 128 - server.returncode)
"""


def serve_command(template: str, model_dir: Path, port: int) -> list[str]:
    """The command's words, each {model} and {port} replaced (not str.format: a command may hold other braces)."""
    return [word.replace("{model}", str(model_dir)).replace("{port}", str(port)) for word in shlex.split(template)]


def answers(url: str) -> bool:
    """Whether a server at url lists its models yet."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def last_line(log_file: Path) -> str:
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "empty"


def identity(pid: int) -> str | None:
    """What tells process `pid` from a later one given the same pid: this boot's id and the process's start time (in
    clock ticks since boot, /proc/PID/stat's 22nd field); None when no such process is alive (a zombie holds no
    memory and no port). Without /proc (macOS) always None: a leftover there is never killed, as no pid can be told
    from a reused one (the watcher has stopped the server when its trainer ended)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else f"{boot} {fields[19]}"


def note_server(pid_file: Path, pid: int, shown: str) -> None:
    """The pid file of a server's process group (its leader's pid), with what tells that process from a later one."""
    storage.write_text(pid_file, json.dumps({"pid": pid, "identity": identity(pid), "command": shown}) + "\n")


def clear_leftovers(directory: Path) -> None:
    """(rank 0) What a run killed while it served a round's policy left in its rounds directory: each server a pid
    file names that still runs and is the very process the file recorded (a pid reused since is another's, and left
    alone), killed with its whole process group; the pid files; the policy's copies (a kill mid-removal's too). One
    line says what was found."""
    done = []
    for pid_file in sorted(directory.glob("server-*.pid")):
        recorded = json.loads(pid_file.read_text())
        pid, now = recorded["pid"], identity(recorded["pid"])
        if now is None:  # stopped by its watcher when its trainer ended
            done.append(f"{pid_file.name} removed (its server had stopped)")
        elif now == recorded["identity"]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + GONE_WITHIN
            while identity(pid) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            done.append(f"its server killed (process group {pid}, {pid_file.name})")
        else:
            done.append(f"{pid_file.name} removed (pid {pid} is another process's now: left alone)")
        pid_file.unlink()
    for copy in sorted(directory.glob("policy-*")):
        storage.remove_tree(copy)
        done.append(f"{copy.name}/ removed")
    if done:
        print(f"rounds.server: an earlier run left {directory}: " + "; ".join(done))


class PolicyServer:
    """The server of one round's policy, on this process's machine: started on entering, ready once its /v1/models
    answers (within `timeout` seconds), stopped on leaving, however the block left."""

    def __init__(self, template: str, model_dir: Path, log_file: Path, timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command, self.log_file, self.timeout = serve_command(template, model_dir, self.port), log_file, timeout
        self.pid_file = log_file.with_suffix(".pid")

    def __enter__(self) -> "PolicyServer":
        shown = shlex.join(self.command)
        print(f"rounds.server: starting `{shown}`; its output: {self.log_file}")
        watched, self.alive = os.pipe()  # the write end is this process's alone: not inherited (O_CLOEXEC)
        with open(self.log_file, "w") as log:
            try:
                self.process = subprocess.Popen([sys.executable, "-c", WATCHER, str(watched), str(STOP_GRACE),
                                                 *self.command], stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True,
                                                pass_fds=(watched,))  # fmt: skip
            except OSError as error:
                os.close(self.alive)
                raise UserError(f"rounds.server: could not start `{shown}`: {error.strerror or error}") from None
            finally:
                os.close(watched)
        try:
            # for a resumed run to stop the server, should it outlive this process (its watcher killed too)
            note_server(self.pid_file, self.process.pid, shown)
            self.wait(shown)
        except BaseException:
            self.stop()
            raise
        return self

    def wait(self, shown: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not answers(self.url):
            code = self.process.poll()
            if code is not None:
                raise UserError(f"rounds.server: `{shown}` exited with code {code} before serving at {self.url} "
                                f"({self.log_file}: {last_line(self.log_file)})")  # fmt: skip
            if time.monotonic() > deadline:
                raise UserError(f"rounds.server: `{shown}` did not answer at {self.url}/v1/models within "
                                f"{self.timeout:g} s (rounds.server_timeout); its output: {self.log_file}")  # fmt: skip
            time.sleep(POLL)

    def stop(self) -> None:
        """The server's whole process group ended (an engine's workers, a wrapper's children): the watcher's pipe
        closed, on which it sends SIGTERM, then SIGKILL after STOP_GRACE; the group killed here as well should the
        watcher not finish (or have been killed itself); the pid file removed."""
        os.close(self.alive)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_GRACE + GONE_WITHIN)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.pid_file.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        self.stop()


def sample_served(settings, directory: Path, round_index: int, policy, tokenizer, topology: Topology,
                  rows: tuple[list, list[float], float], max_new_tokens: int) -> list[list[int]]:  # fmt: skip
    """The completions of rows (prompts, temperatures, top_p) of the round's policy, served by settings.server (the
    rounds.* settings) with settings.server_timeout: the policy written to directory/policy-R (every rank its shards),
    served and asked on rank 0, the completions on every rank. The server's output is kept in server-R.log. First,
    what a run killed while serving left is cleared: a resume of it reaches here first, as it samples that round anew
    (its file is written once sampled)."""
    model_dir, log_file = directory / f"policy-{round_index}", directory / f"server-{round_index}.log"
    topology.run_on_main(lambda: clear_leftovers(directory))
    export_live(model_dir, policy, tokenizer, topology)

    def ask() -> list[list[int]]:
        try:
            with PolicyServer(settings.server, model_dir, log_file, settings.server_timeout) as server:
                sampler = ServerSampler(server.url, tokenizer, max_new_tokens, settings.server_timeout, topology,
                                        setting="rounds.server")  # fmt: skip
                sampler.check(str(model_dir))
                return sampler.sample_here(*rows)
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)

    return topology.broadcast(topology.run_on_main(ask))
