"""Expert corrections from the policy's own states (experiments/binary_search_rl/corrections.py):
the branch falls on the first call the expert would not make, the policy's turns before it are
context only, and the expert finishes from the workspace the policy left."""
import pytest

from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import binary_search_task, workspace_files
from jaxrl_agent.env.tools import ToolConfig, create_workspaces, format_tool_call

from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.corrections import collect_corrections, correct, episode_calls
from experiments.binary_search_rl.edits import policy_turns
from experiments.binary_search_rl.stages import chat_format


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(num_workers=1, timeout_s=10) as sb:
        yield sb


def _calls(path, *edits, tests=True, submit=True):
    out = [format_tool_call("list_files"), format_tool_call("read_file", {"path": path})]
    out += [format_tool_call("run_tests")] if tests else []
    out += [format_tool_call("replace_lines", dict(path=path, start=s, end=s, text=t)) for s, t in edits]
    return out + ([format_tool_call("submit")] if submit else [])


def test_a_wrong_edit_branches_and_the_expert_fixes_from_there(tmp_path, sandbox):
    task = binary_search_task()
    path = task.metadata["source_file"]
    chat = chat_format(StudyConfig())
    cfg = ToolConfig(test_timeout_s=0.05)
    bugs = sorted(task.metadata["bugs"], key=lambda b: b["line"])
    right = [(b["line"], b["fixed"].rstrip("\n")) for b in bugs]
    # the expert's own calls: every one accepted, nothing to correct
    ws = create_workspaces(workspace_files(task), str(tmp_path / "a"), 1)[0]
    assert correct(task, _calls(path, *right), chat, sandbox, cfg, ws) == (None, {})
    # one right edit, then a correct line rewritten: the branch is the rewrite (call 4)
    wrong = (1, "def nope():")
    ws = create_workspaces(workspace_files(task), str(tmp_path / "b"), 1)[0]
    ep, info = correct(task, _calls(path, right[0], wrong, right[1]), chat, sandbox, cfg, ws)
    assert info == {"branch": 4, "policy_call": "replace_lines"}
    # in the loss: the expert's turns only, from the state the policy's accepted calls left
    assert episode_calls(ep, chat.tokenizer.decode) == [
        format_tool_call("replace_lines", dict(path=path, start=right[1][0], end=right[1][0], text=right[1][1])),
        format_tool_call("run_tests"), format_tool_call("submit")]
    whole = chat.tokenizer.decode(ep.ids)
    at = [whole.index(c) for c in _calls(path, right[0], submit=False)]  # the policy's turns, as context
    assert at == sorted(at) and at[-1] < whole.index(format_tool_call("run_tests"), at[-1] + 1)
    assert format_tool_call("replace_lines", dict(path=path, start=1, end=1, text=wrong[1])) not in whole
    assert ep.reward == 1.0 and ep.info["style"] == "correction" and sum(ep.loss_mask) > 0
    # submitting with a bug left branches at the submit; a parse error at its own turn
    ws = create_workspaces(workspace_files(task), str(tmp_path / "c"), 1)[0]
    _, info = correct(task, _calls(path, right[0]), chat, sandbox, cfg, ws)
    assert info == {"branch": 4, "policy_call": "submit"}
    ws = create_workspaces(workspace_files(task), str(tmp_path / "d"), 1)[0]
    _, info = correct(task, ["<tool_call>\n{\"nam"], chat, sandbox, cfg, ws)
    assert info == {"branch": 0, "policy_call": "?"}
    # without decisions corrected, the early submit stands (nothing to correct: RL's to learn)
    ws = create_workspaces(workspace_files(task), str(tmp_path / "c2"), 1)[0]
    assert correct(task, _calls(path, right[0]), chat, sandbox, cfg, ws, decisions=False) == (None, {})
    ws = create_workspaces(workspace_files(task), str(tmp_path / "b2"), 1)[0]
    _, info = correct(task, _calls(path, right[0], wrong), chat, sandbox, cfg, ws, decisions=False)
    assert info == {"branch": 4, "policy_call": "replace_lines"}  # a wrong edit is still corrected
    # the same test run twice without a change is not accepted either
    twice = _calls(path, tests=True, submit=False) + [format_tool_call("run_tests")]
    ws = create_workspaces(workspace_files(task), str(tmp_path / "e"), 1)[0]
    ep, info = correct(task, twice, chat, sandbox, cfg, ws)
    assert info["branch"] == 3 and episode_calls(ep, chat.tokenizer.decode)[-1] == format_tool_call("submit")


def test_collect_counts_what_it_corrected_and_drops_long_episodes(sandbox):
    task = binary_search_task()
    path = task.metadata["source_file"]
    chat = chat_format(StudyConfig())
    bad = _calls(path, (1, "def nope():"))
    eps, stats = collect_corrections([task, task], [bad, bad[:1] + [format_tool_call("submit")]], chat, sandbox,
                                     tool_cfg=ToolConfig(test_timeout_s=0.05))
    assert stats["corrected"] == 2 and stats["branch_call"] == {"replace_lines": 1, "submit": 1} and len(eps) == 2
    _, stats = collect_corrections([task], [bad], chat, sandbox, tool_cfg=ToolConfig(test_timeout_s=0.05),
                                   max_tokens=100)
    assert stats["too_long"] == 1 and stats["corrected"] == 0
