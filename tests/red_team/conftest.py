"""Fixtures of the red team: `sb`, one Sandbox pool per test module, and `ws`, a fresh
workspace of the binary search task per test.
"""
import pytest

from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tools import create_workspaces

from .common import TASK


@pytest.fixture(scope="module")
def sb():
    with Sandbox(num_workers=2, timeout_s=10, memory_mb=512) as s:
        yield s


@pytest.fixture
def ws(tmp_path):
    return create_workspaces({**TASK.files, **TASK.dev_tests}, str(tmp_path / "ws"), 1)[0]
