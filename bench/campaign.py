"""A campaign of stages inside one budget of seconds (gpu.py's): each stage a process of its own with a time limit, so
that a stage that fails, hangs or runs slow costs at most its limit and the campaign goes on; its status ("ok",
"failed: ...", "timed out after N s", "skipped: ...") and result recorded in one folder: campaign.json (rewritten
after every stage, so a campaign cut short still holds what it measured), campaign.md (the same as tables) and
campaign.log (every stage's output, in order)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from utils import REPO_ROOT

# pytest -v's outcome lines, with pytest-xdist ("[gw0] [ 50%] PASSED tests/a.py::t") or without ("tests/a.py::t PASSED")
TEST_OUTCOME = re.compile(r"(?:\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+::\S+)|(tests/\S+::\S+) "
                          r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b)")  # fmt: skip
# -rfEs's summary: "FAILED tests/a.py::t - AssertionError: ..." and "SKIPPED [1] tests/a.py:12: reason"
TEST_REASON = re.compile(r"^(FAILED|ERROR) (tests/\S+::\S+) - (.*)$")
SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] (tests/\S+?:\d+): (.*)$")


def outcomes_of_tests(output: str) -> dict:
    """pytest -v -rfEs's output read back: {"tests": {node id: outcome, with a failure's message}, "skips": [file:line:
    reason]}; outcome lines come as each test ends, so a run stopped at its time limit still gives what ended."""
    tests, skips = {}, []
    for line in output.splitlines():
        if match := TEST_REASON.match(line):
            tests[match[2]] = f"{match[1].lower()}: {match[3][:300]}"
        elif match := SKIP_REASON.match(line):
            skips.append(f"{match[1]}: {match[2][:300]}")
        elif (match := TEST_OUTCOME.search(line)) and (match[2] or match[3]) not in tests:
            tests[match[2] or match[3]] = (match[1] or match[4]).lower()
    return {"tests": tests, "skips": skips}


def last_line(output: str) -> str:
    """The output's last non-empty line (an exception's message, pytest's summary), at most 300 characters."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


class Campaign:
    """The stages' record and the time left: run() starts a stage's process, record() writes its outcome."""

    def __init__(self, out: Path, budget: float, header: dict, render: Callable[[dict], str], only=()):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.deadline, self.render, self.only = out, time.monotonic() + budget, render, tuple(only)
        self.report = {"campaign": {**header, "budget_s": budget, "only": list(only)}, "stages": []}
        (out / "campaign.log").write_text("")
        self.write()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, name: str, status: str, seconds: float = 0.0, **result) -> dict:
        """A stage's outcome, added to the report, and the folder's files rewritten; printed as one line."""
        stage = {"name": name, "status": status, "seconds": round(seconds, 1), **result}
        self.report["stages"].append(stage)
        self.write()
        print(f"{name}: {status} ({seconds:.0f} s)", flush=True)
        return stage

    def write(self) -> None:
        (self.out / "campaign.json").write_text(json.dumps(self.report, indent=1) + "\n")
        (self.out / "campaign.md").write_text(self.render(self.report))

    def run(self, name: str, argv: list[str], limit: float, least: float = 10.0) -> tuple[str, float, str]:
        """(status, seconds, output) of argv run from the repository's root in a process group of its own, stopped
        (the whole group: pytest's and torchrun's children too) after `limit` seconds or at the budget's end; not
        started where less than `least` seconds of the budget are left, nor where `only` names texts and the stage's
        name holds none of them (a second, shorter call on a lease). Its output is appended to campaign.log."""
        if self.only and not any(text in name for text in self.only):
            return "skipped: not selected (--only)", 0.0, ""
        limit = min(limit, self.remaining())
        if limit < least:
            return f"skipped: out of budget ({max(0.0, self.remaining()):.0f} s left)", 0.0, ""
        start = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", start_new_session=True)  # fmt: skip
        try:
            output, _ = process.communicate(timeout=limit)
            status = "ok" if process.returncode == 0 else f"failed: exit {process.returncode}: {last_line(output)}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            status = f"timed out after {limit:.0f} s"
        with open(self.out / "campaign.log", "a") as log:
            log.write(f"===== {name}: {status}\n{output}\n")
        return status, time.monotonic() - start, output

    def worker(self, name: str, worker: Callable, result_file: Path, limit: float, summary=None, **kwargs) -> dict:
        """worker(result_file=..., **kwargs) (a function of the bench package) as a stage: its result (the JSON
        it writes, or summary of it) recorded with its status."""
        result_file.unlink(missing_ok=True)
        call = f"importlib.import_module({worker.__module__!r}).{worker.__name__}(result_file={str(result_file)!r}, " \
               f"**{kwargs!r})"  # fmt: skip
        code = f"import importlib, sys; sys.path.insert(0, {str(REPO_ROOT)!r}); {call}"
        status, seconds, _ = self.run(name, [sys.executable, "-c", code], limit)
        result = json.loads(result_file.read_text()) if status == "ok" and result_file.exists() else None
        if result is not None and summary is not None:
            result = summary(result)
        return self.record(name, status, seconds, result=result)
