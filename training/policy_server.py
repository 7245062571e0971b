"""A round's policy sampled by an engine the user names (rounds.server: a command holding {model} and {port}, such as
`vllm serve {model} --port {port}`). For each round the policy is written as a from_pretrained directory (its weights
as they are now; a LoRA policy's merged into its base), the command started on rank 0 in a session of its own with
its output in a log beside the round's file, and waited for until its /v1/models answers; the round's rows are asked
for through generation.server_sampling.ServerSampler (the served model checked to be that directory, its vocabulary
ours); then the server is stopped (its whole process group: SIGTERM, SIGKILL after STOP_GRACE seconds) and the directory
removed, whatever happened, before the round's reference pass and training need the memory back. Why a server
started per round, and what it costs: docs/rounds.md#sampling-by-a-server."""

import os
import shlex
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from generation.server_sampling import ServerSampler
from modeling.distributed import Topology, free_port
from persistence.checkpoint import export_live
from utils import UserError

STOP_GRACE = 30  # seconds a server has to exit on SIGTERM before its process group is killed
POLL = 0.5  # seconds between two asks whether the server answers yet


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


class PolicyServer:
    """The server of one round's policy, on this process's machine: started on entering, ready once its /v1/models
    answers (within `timeout` seconds), stopped on leaving, however the block left."""

    def __init__(self, template: str, model_dir: Path, log_file: Path, timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command, self.log_file, self.timeout = serve_command(template, model_dir, self.port), log_file, timeout

    def __enter__(self) -> "PolicyServer":
        shown = shlex.join(self.command)
        print(f"rounds.server: starting `{shown}`; its output: {self.log_file}")
        with open(self.log_file, "w") as log:
            try:
                self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            except OSError as error:
                raise UserError(f"rounds.server: could not start `{shown}`: {error.strerror or error}") from None
        try:
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
        """The server's whole process group ended (an engine's workers too): SIGTERM, then SIGKILL."""
        if self.process.poll() is not None:
            return
        for sent, grace in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, None)):
            try:
                os.killpg(self.process.pid, sent)
            except ProcessLookupError:
                return
            try:
                self.process.wait(grace)
                return
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, *exc) -> None:
        self.stop()


def sample_served(settings, directory: Path, round_index: int, policy, tokenizer, topology: Topology,
                  rows: tuple[list, list[float], float], max_new_tokens: int) -> list[list[int]]:  # fmt: skip
    """The completions of rows (prompts, temperatures, top_p) of the round's policy, served by settings.server (the
    rounds.* settings) with settings.server_timeout: the policy written to directory/policy-R (every rank its shards),
    served and asked on rank 0, the completions on every rank. The server's output is kept in server-R.log."""
    model_dir, log_file = directory / f"policy-{round_index}", directory / f"server-{round_index}.log"
    topology.run_on_main(lambda: shutil.rmtree(model_dir, ignore_errors=True))  # a copy left by a killed run
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
