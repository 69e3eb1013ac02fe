"""The README's commands stay true: CI runs the README's test command."""

import os
import re

import pytest

from tests.support import warm

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    demo, tests = readme_commands()[:2]
    assert "python -m keras_pipe.demo" in demo
    assert "pytest" in tests
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert tests in ci.splitlines()


def test_demo_trains_above_chance():
    # A short run of the main job (the README's first command runs it with
    # the defaults: 8 epochs on 8192 samples).
    proc = warm.run(["-m", "keras_pipe.demo", "--epochs", "3",
                     "--samples", "2048"], warm.env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "/device:CPU:3" in proc.stdout  # the stage/device table
    assert "stage 3  .  .  . F0 F1" in proc.stdout  # the schedule
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)",
                               proc.stdout).group(1))
    assert accuracy > 0.5, proc.stdout[-2000:]  # chance is 0.25
