"""HOST: scripted-expert demonstrations as token episodes (the SFT data).

The expert (`env/expert.py`) plays through the real tools of the chat format's tool style
(`replace_lines` edits in "short", `str_replace` in "full"); here each of its assistant
messages becomes sampled-style ids (loss_mask 1) and each tool result the rendered
observation (loss_mask 0), through the same `EpisodeBuilder` and chat format as a rollout,
so SFT trains on exactly the token layout the policy later samples in.
"""
from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from jaxrl_agent.agent.rollout import episode_prompt
from jaxrl_agent.chat_template import IM_END
from jaxrl_agent.config import SYSTEM_PROMPT
from jaxrl_agent.env.expert import Transcript, run_expert
from jaxrl_agent.env.tasks import Task, workspace_files
from jaxrl_agent.env.tools import ToolConfig, create_workspaces
from jaxrl_agent.tokenizer import ChatFormat, EpisodeBuilder
from jaxrl_agent.trajectory import Episode


def transcript_to_episode(tr: Transcript, task: Task, chat: ChatFormat, *, system_prompt: str = SYSTEM_PROMPT,
                          group_id: int = 0) -> Episode:
    """One expert transcript -> an Episode (assistant ids loss_mask 1, sampler_logp 0)."""
    builder = EpisodeBuilder(chat, episode_prompt(task, system_prompt), chat.tool_schemas)
    for k, (text, observation) in enumerate(tr.turns):
        ids = chat.tokenizer.encode(text + IM_END)
        builder.append_sampled(ids, [0.0] * len(ids))
        if k + 1 < len(tr.turns):  # the last turn (submit) ends the episode: no observation
            builder.append_observation(observation)
    info = {"task_id": task.task_id, "template": str(task.metadata.get("template", "")), "style": tr.style,
            "verify": tr.verify_info}
    return Episode.from_builder(builder, reward=tr.reward, group_id=group_id,
                                termination=tr.termination or "", info=info)


def collect_demonstrations(tasks: Sequence[Task], sandbox, chat: ChatFormat, styles: Sequence[str], *,
                           threads: int = 2, tool_cfg: ToolConfig = ToolConfig(),
                           system_prompt: str = SYSTEM_PROMPT) -> list[Episode]:
    """Run the expert once per (task, style) and return the episodes in (task, style) order.

    The expert is deterministic, so the data set is the same whatever the thread scheduling.
    """
    jobs = [(i, s) for i in range(len(tasks)) for s in styles]
    with tempfile.TemporaryDirectory(prefix="jxa-demos-") as root:
        def one(job):
            i, style = job
            ws = create_workspaces(workspace_files(tasks[i]), os.path.join(root, f"{i}-{style}"), 1)[0]
            tr = run_expert(tasks[i], ws, sandbox, style, tool_cfg, chat.tool_style)
            return transcript_to_episode(tr, tasks[i], chat, system_prompt=system_prompt, group_id=i)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            return list(pool.map(one, jobs))
