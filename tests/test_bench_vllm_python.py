"""bench --generate --vllm PYTHON: a PYTHON that cannot run vLLM is refused in one line before any work (issue 70:
a missing one ran the whole float32 half of the bench and then ended in a FileNotFoundError traceback)."""

import importlib.util
import sys

import pytest

import bench.__main__
from bench import generate


def refusal(monkeypatch, capsys, python: str) -> str:
    """stderr of `python -m bench --generate --vllm python`, which must stop before any campaign starts."""
    monkeypatch.setattr(bench.__main__, "run", lambda args: pytest.fail("the bench started before --vllm's check"))
    with pytest.raises(SystemExit) as exit:
        bench.__main__.main(["--generate", "--vllm", python])
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_a_missing_or_unrunnable_vllm_python_is_refused_in_one_line_before_any_work(monkeypatch, capsys, tmp_path):
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    text = tmp_path / "text"
    text.write_text("not a program\n")
    text.chmod(0o755)
    for python, problem in (
        ("/nonexistent/python", "no such file; give the python of an environment with vLLM"),
        ("no-such-python-here", "no such command on PATH"),
        (str(script), "not executable"),
        (str(tmp_path), "a directory"),
        (str(text), "cannot be run (Exec format error)"),
    ):
        assert refusal(monkeypatch, capsys, python) == f"error: --vllm {python}: {problem}\n"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this environment has vLLM")
def test_a_python_without_vllm_is_refused_in_one_line_before_any_work(monkeypatch, capsys):
    assert refusal(monkeypatch, capsys, sys.executable) == (
        f"error: --vllm {sys.executable}: cannot import vllm (ModuleNotFoundError: No module named 'vllm'); give the "
        "python of an environment with vLLM\n"
    )


def test_a_python_with_vllm_passes_the_check(tmp_path, monkeypatch):
    # A stand-in environment: a vllm module on the path of the python given is all the check asks for.
    (tmp_path / "vllm.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    generate.check_vllm_python(sys.executable)


def test_a_vllm_import_that_hangs_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "vllm.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(generate, "VLLM_IMPORT_SECONDS", 1)
    assert refusal(monkeypatch, capsys, sys.executable) == (
        f"error: --vllm {sys.executable}: `import vllm` did not finish in 1 s\n"
    )
