"""Shared pieces of the RL-loop tests (a one-step tool-choice task, its configs, a tiny SFT
policy that calls `submit` about half the time), and the worker process that
test_rl_distributed.py launches:

    python tests/rl_worker.py POLICY_DIR RUN_DIR OUT_JSON   (environment from the test)

The worker joins the `jax.distributed` job (`sharding.initialize_distributed`), runs
`run_two_iterations` from POLICY_DIR, the second iteration resumed from the first one's
checkpoint, and writes what it saw: the episodes it rolled out itself (a count per
`collect_episodes` call) and, on process 0, the final parameters and the logged metrics.
"""
from __future__ import annotations

import json
import sys

import numpy as np

SOURCE = "def answer():\n    return 42\n"
TEST = "from answer import answer\n\n\ndef test_answer():\n    assert answer() == 42\n"


def submit_task(i: int):
    """Already correct: submitting it earns 1; any other first call ends the episode with 0."""
    from jaxrl_agent.env.tasks import Task

    return Task(task_id=f"submit-{i}", instruction="The repository is already correct. Submit it.",
                files={"answer.py": SOURCE}, dev_tests={"test_answer.py": TEST},
                hidden_tests={"test_hidden_answer.py": TEST}, reference_files={"answer.py": SOURCE},
                metadata={"template": "submit_only", "split": "custom"})


def configs():
    """(TASKS, TOOLS, ROLLOUT, SAMPLING, TRAJ) of the one-step task."""
    from jaxrl_agent.config import RolloutConfig, SamplingConfig, TrajectoryConfig
    from jaxrl_agent.env.tools import ToolConfig

    return ([submit_task(i) for i in range(4)], ToolConfig(max_turns=1),
            RolloutConfig(group_size=8, max_total_tokens=256, max_tokens_per_turn=32),
            SamplingConfig(max_new_tokens=32, batch_size=16, cache_size=256, prefill_buckets=(256,)),
            TrajectoryConfig(buckets=(256,)))


def rl_config(run_dir: str, **kw):
    from jaxrl_agent.config import RLConfig

    base = dict(iterations=2, tasks_per_iter=2, eval_tasks=2, eval_samples=4, eval_every=0, num_train_tasks=4,
                run_dir=run_dir, checkpoint_every=1, sandbox_workers=2)
    return RLConfig(**{**base, **kw})


def sft_policy(tok):
    """A tiny policy that calls `submit` about half the time and `list_files` otherwise."""
    from flax import nnx

    from jaxrl_agent.agent.rollout import episode_prompt
    from jaxrl_agent.chat_template import IM_END
    from jaxrl_agent.config import SYSTEM_PROMPT, OptimConfig, TrainConfig
    from jaxrl_agent.env.tools import format_tool_call
    from jaxrl_agent.loops.offline import run_sft
    from jaxrl_agent.model.decoder import CausalLM, ModelConfig
    from jaxrl_agent.tokenizer import ChatFormat, EpisodeBuilder
    from jaxrl_agent.train.weight_sync import policy_for_engine
    from jaxrl_agent.trajectory import Episode

    tasks, _, _, _, traj = configs()
    chat = ChatFormat(tok, tool_style="short")
    demos = []
    for i, name in enumerate(["submit", "list_files"] * 8):
        b = EpisodeBuilder(chat, episode_prompt(tasks[i % 4], SYSTEM_PROMPT), chat.tool_schemas)
        ids = tok.encode(format_tool_call(name, {}) + IM_END)
        b.append_sampled(ids, [0.0] * len(ids))
        demos.append(Episode.from_builder(b, termination="submitted"))
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=True,
                      architecture="Qwen2ForCausalLM")
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    state, hist, ts = run_sft(model, demos, train_cfg=TrainConfig(), optim_cfg=OptimConfig(learning_rate=1e-2),
                              traj_cfg=traj, num_steps=60, batch_size=16)
    assert hist[-1]["loss"] < 0.1 * hist[0]["loss"]
    return policy_for_engine(ts, state)


# Adam's g / sqrt(v) turns float summation-order noise in near-zero gradients into full-size
# steps; eps = 1 makes the update ~ lr * g, so two meshes agree to float tolerance.
DIST_OPTIM = dict(learning_rate=0.1, eps=1.0)


def run_two_iterations(model, tok, run_dir: str, **rl_kw) -> list[dict]:
    """Iteration 1, then iteration 2 resumed from its checkpoint; the logged iterations and
    the final result."""
    from jaxrl_agent.config import OptimConfig, TrainConfig
    from jaxrl_agent.loops.rl import train_rl

    tasks, tools, rollout, sampling, traj = configs()
    kw = dict(rollout=rollout, sampling=sampling, train=TrainConfig(), optim=OptimConfig(**DIST_OPTIM), tools=tools,
              traj=traj, train_tasks=tasks, eval_tasks=tasks[:2], show_progress=False)
    first = train_rl(model, tok, rl=rl_config(run_dir, iterations=1, **rl_kw), **kw)
    second = train_rl(model, tok, rl=rl_config(run_dir, iterations=2, **rl_kw), resume=True, **kw)
    return first["iterations"] + second["iterations"], second


def main(policy_dir: str, run_dir: str, out_path: str) -> None:
    from jaxrl_agent.train import sharding as sh

    sh.initialize_distributed()  # before anything touches the backend
    import jax

    import jaxrl_agent.loops.evaluate as eval_mod
    import jaxrl_agent.loops.rl as rl_mod
    from jaxrl_agent.agent.policy import load_policy

    local_episodes = []
    collect = rl_mod.collect_episodes

    def counting(tasks, *a, **k):
        eps, stats = collect(tasks, *a, **k)
        local_episodes.append(len(eps))
        return eps, stats
    rl_mod.collect_episodes = eval_mod.collect_episodes = counting  # the repeat check; batches and evaluations
    model, tok = load_policy(policy_dir)
    iterations, res = run_two_iterations(model, tok, run_dir)
    out = {"process": jax.process_index(), "processes": jax.process_count(), "local_episodes": local_episodes,
           "iterations": iterations, "before": res.get("before"), "after": {k: res["after"][k] for k in
                                                                            ("n_episodes", "pass1")}}
    params = res["train_step"].host_policy_params(res["state"])
    if jax.process_index() == 0:
        np.savez(out_path + ".npz", **params)
    with open(f"{out_path}.{jax.process_index()}.json", "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:4])
