"""The multi-turn agent GRPO iteration side by side: ours (`rollout.collect_episodes` on the
sampling engine, one sharded update) against TRL 1.16 `GRPOTrainer` driven through its
`rollout_func`, both on the project's own tools, sandbox and verifier, in one process.

    python benchmarks/bench_vs_trl_agent.py [--iterations=2]   -> benchmarks/results/vs_trl_agent.json

Both sides run the same episodes' loop, `rollout.collect_episodes`: `--tasks` bug-fixing tasks
x `--group` episodes, up to 12 turns and 1024 tokens each, the tools in a sandbox, the verifier's
reward. Only the engine differs. Ours is `SamplingEngine` (KV cache kept across turns, only the
new observation prefilled). TRL's side is `TorchEngine` below: each turn,
`transformers.generate` runs on the whole conversation so far, batched over the rows that are
ready (what TRL's own tool loop does). `rollout_func` hands TRL the episodes with their sampler
log-probs, `env_mask` (observation tokens 0) and the verifier's reward. The update is the
single-turn benchmark's: token-mean GRPO, clip 0.2, AdamW, no KL, float32
(`bench_vs_trl.py`, whose interleaving and thread settings this reuses). Ours runs its batch
packed for the model (`--rows`, default `packed`: the same loss and gradient as whole rows,
tests/test_packed_forward.py); TRL pads every row to the batch's longest.

`--settings` picks the episode loop's settings, the same for both sides:
- `default`: the library defaults (`ToolConfig()`: 0.5 s CPU per test; `RolloutConfig()`: the
  verifier's 1 s per test; every sandbox call run);
- `rl_default`: the RL loop's defaults (`train_rl` with `RLConfig()`): the library's limits
  above, identical sandbox calls sharing one execution (`RLConfig.sandbox_memo`, on by
  default); -> `vs_trl_agent_rl_default.json`;
- `study`: the RL loop as the study runs it (0.05 s per test for the tools and the verifier,
  identical sandbox calls sharing one execution, `Sandbox(memo_entries=...)`). Each side has
  its own sandbox, so neither side's memo answers the other's calls; -> `vs_trl_agent_study.json`.
A memo is emptied before each rollout: every iteration here reruns the same tasks, while the RL
loop draws new ones, so calls are shared within a rollout only, as in an RL iteration.
The tools and the verifier are the same for both sides, so what they cost is a shared floor
under both times: the `study` settings lower that floor, the engines' difference stays.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_vs_trl as single  # noqa: E402

MAX_TOTAL = 1024
STUDY_TEST_LIMIT_S = 0.05  # experiments/binary_search_rl/config.py, StudyConfig.test_timeout_s


class TorchTurn:
    """The slice of `sampling_engine.TurnResult` that `collect_episodes` reads."""

    def __init__(self, out: dict, finish: tuple):
        self._out, self.finish_reason = out, finish

    def row(self, r: int):
        ids, logp = self._out[r]
        return ids, logp, logp


class TorchEngine:
    """A `SamplingEngine` stand-in on a transformers model: rows hold conversations, and every
    turn re-runs `generate` over each ready row's whole conversation (left-padded batch)."""

    def __init__(self, model, config, pad_id: int):
        self.model, self.config, self.pad = model, config, pad_id
        self.rows: dict[int, list[int]] = {}

    def free_rows(self) -> list[int]:
        return [r for r in range(self.config.batch_size) if r not in self.rows]

    def start_episode(self, row: int, ids, seed: int | None = None) -> None:
        self.rows[row] = list(ids)

    def append(self, row: int, ids) -> None:
        self.rows[row].extend(int(i) for i in ids)

    def end_episode(self, row: int) -> None:
        self.rows.pop(row, None)

    def begin_turn(self, rows, max_new_tokens: int) -> None:
        self.speaking, self.max_new = [*getattr(self, "speaking", []), *rows], max_new_tokens

    def advance(self, max_steps: int) -> TorchTurn:
        """Every ready row's whole turn in one `generate` (TRL's loop has no mid-turn hand-off)."""
        rows, self.speaking = self.speaking, []
        return self.sample_turn(rows, self.max_new)

    def sample_turn(self, rows, max_new_tokens: int) -> TorchTurn:
        import torch

        rows = list(rows)
        seqs = [self.rows[r] for r in rows]
        room = [self.config.cache_size - len(s) for s in seqs]
        new = max(1, min(max_new_tokens, max(room)))
        width = max(map(len, seqs))
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        stops = list(self.config.stop_token_ids)
        with torch.inference_mode():
            gen = self.model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=new, eos_token_id=stops, pad_token_id=self.pad,
                                      output_scores=True, return_dict_in_generate=True)
        seq = gen.sequences[:, width:]
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in gen.scores], 1)  # [R, n, V]
        picked = logp.gather(-1, seq[:, : logp.shape[1], None])[..., 0]
        out, finish = {}, {}
        for i, r in enumerate(rows):
            toks = seq[i].tolist()
            end = next((k + 1 for k, t in enumerate(toks) if t in stops), len(toks))
            reason = "stop" if end <= len(toks) and toks[end - 1] in stops else "length"
            if end > room[i]:
                end, reason = max(room[i], 0), "cache_full"
            out[r] = (toks[:end], picked[i, :end].tolist())
            finish[r] = reason
            # The row's conversation goes on from what it said (SamplingEngine keeps it in its
            # cache): `collect_episodes` appends only observations.
            self.rows[r].extend(toks[:end])
        return TorchTurn(out, tuple(finish.get(r) for r in range(self.config.batch_size)))


class Agent:
    """The shared pieces: tasks, chat format, the loop's settings, and one `collect_episodes`
    call (in the calling side's own sandbox)."""

    def __init__(self, policy: str, tasks: int, settings: str = "default"):
        from jaxrl_agent.config import RolloutConfig
        from jaxrl_agent.env.tasks import generate_tasks
        from jaxrl_agent.env.tools import ToolConfig
        from jaxrl_agent.tokenizer import ChatFormat, load_tokenizer

        self.tok = load_tokenizer(policy)
        self.chat = ChatFormat(self.tok, tool_style="short")
        self.tasks = generate_tasks("train", tasks, seed=0)
        self.prompts, _ = single.task_prompts(self.tok, tasks)
        self.by_prompt = dict(zip(self.prompts, self.tasks))
        study = settings == "study"
        self.tool_cfg = ToolConfig(test_timeout_s=STUDY_TEST_LIMIT_S) if study else ToolConfig()
        self.rollout_cfg = RolloutConfig(max_total_tokens=MAX_TOTAL,
                                         **({"verify_test_timeout_s": STUDY_TEST_LIMIT_S} if study else {}))

    def rollout(self, tasks, engine, sandbox, group: int, seed: int):
        """(episodes, where the time went): `collect_episodes`' stats plus `env_cpu_s`, the CPU
        seconds the sandbox's workers and their children spent on this rollout's tool calls
        and verifications (None if a worker was replaced meanwhile)."""
        from jaxrl_agent.agent.rollout import collect_episodes
        from jaxrl_agent.env.sandbox_memo import CallMemo

        if sandbox.memo is not None:  # emptied per rollout: the RL loop draws new tasks each iteration,
            # so only one rollout's calls share; this benchmark reruns the same tasks
            sandbox.memo = CallMemo(sandbox.memo.max_entries)
        pids, cpu0 = sandbox.worker_pids(), worker_cpu_s(sandbox.worker_pids())
        eps, stats = collect_episodes(tasks, engine, self.chat, sandbox, replace(self.rollout_cfg, group_size=group),
                                      self.tool_cfg, seed=seed)
        same = sandbox.worker_pids() == pids
        return eps, {"sampling_s": stats.seconds_sampling,
                     "env_cpu_s": worker_cpu_s(pids) - cpu0 if same else None}


def worker_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, with waited-for children: the jailed runs) of these
    processes so far, from /proc (Linux, as the sandbox itself)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime (stat fields 14-17)
    return total / tick


class OursAgent:
    """Our multi-turn iteration: G episodes per task on the engine, collate, one update."""

    def __init__(self, agent: Agent, args, sandbox):
        from jaxrl_agent.agent.policy import load_policy
        from jaxrl_agent.config import LossConfig, OptimConfig, RolloutConfig, TrainConfig, TrajectoryConfig
        from jaxrl_agent.losses.registry import LOSSES
        from jaxrl_agent.sampling.engine import SamplingEngine
        from jaxrl_agent.sampling.engine_config import episode_engine
        from jaxrl_agent.train.step import make_optimizer, make_train_step
        from jaxrl_agent.train.weight_sync import policy_for_engine, sync_engine

        self.agent, self.group, self.sandbox = agent, args.group, sandbox
        model, tok = load_policy(args.policy)
        self.ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=args.lr)),
                                  TrainConfig(loss=LossConfig(agg="token-mean", kl_coef=0.0)), model)
        self.state = self.ts.init_state(model, seed=0)
        # --rows: how the update lays out the batch (benchmarks/bench_update_layouts.py times all
        # three on one rollout). packed: the rows packed for the model into rows of the budget,
        # the packed row count in steps of a twelfth of the batch from two thirds of it (this
        # workload's episodes, ~650 of up to 1024 tokens, never pack tighter; five compiles);
        # shared: a group's first prompt once, in one prefix shape (up to 256 tokens, the tasks'
        # prompts); whole: TRL's layout
        mult = self.ts.mesh.devices.size
        rows = -(-args.tasks * args.group // mult) * mult
        step = -(-rows // (12 * mult)) * mult
        buckets = (MAX_TOTAL,) if args.rows == "packed" else tuple(range(128, MAX_TOTAL + 128, 128))
        self.traj = TrajectoryConfig(buckets=buckets, batch_multiple=mult, share_prefix_min=0,
                                     pack_forward=args.rows == "packed",
                                     pack_rows=tuple(range(-(-2 * rows // (3 * step)) * step, rows + 1, step)))
        if args.rows == "shared":
            self.traj = replace(self.traj, share_prefix_min=32, prefix_buckets=(256,),
                                prefix_rows=(-(-(args.tasks + 1) // mult) * mult,))
        sampling = episode_engine(tok, RolloutConfig(max_total_tokens=MAX_TOTAL))
        self.engine = SamplingEngine(policy_for_engine(self.ts, self.state), sampling)
        self.engine.warmup()  # every prefill / decode bucket, and every train-step length bucket:
        from jaxrl_agent.trajectory import collate, shape_episodes  # the timed iterations compile nothing

        pad = shape_episodes(replace(self.traj, pad_id=tok.pad_id))
        shapes = [replace(self.traj, buckets=(t,), row_buckets=(rows,), pack_rows=(p,))
                  for t in self.traj.buckets for p in (self.traj.pack_rows if self.traj.pack_forward else (rows,))]
        for f in self.ts.precompile([collate(pad, cfg)[0] for cfg in shapes]):
            f.result()
        self._refresh = lambda: sync_engine(self.engine, self.ts, self.state)
        self.iteration = 0

    def step(self) -> dict:
        from jaxrl_agent.trajectory import collate

        t0 = time.perf_counter()
        eps, env = self.agent.rollout(self.agent.tasks, self.engine, self.sandbox, self.group,
                                      seed=1000 * self.iteration)
        t1 = time.perf_counter()
        self.state, metrics = self.ts(self.state, collate(eps, self.traj)[0])
        self._refresh()
        float(metrics["loss"])
        t2 = time.perf_counter()
        self.iteration += 1
        return _row(eps, t2 - t0, t1 - t0, t2 - t1, env)


def _row(eps, s: float, gen_s: float, update_s: float, env: dict) -> dict:
    policy = sum(int(np.sum(e.loss_mask)) for e in eps)
    return {"s": s, "generation_s": gen_s, "update_s": update_s, "new_tokens": policy,
            "tokens": sum(len(e) for e in eps), "success": float(np.mean([e.reward for e in eps])),
            "turns": float(np.mean([max(e.turn_id) + 1 for e in eps])), **env}


def trl_agent_pass(agent: Agent, args, threads: int, ours: OursAgent, sandbox) -> dict:
    """`GRPOTrainer.train()` with a `rollout_func` running our episode loop on `TorchEngine`;
    one of our iterations after each of its steps."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from jaxrl_agent.sampling.engine_config import agent_sampling

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(args.policy)
    rows, gen = [], {"s": 0.0, "eps": []}
    sampling = replace(agent_sampling(stop_token_ids=tuple(agent.tok.stop_ids)), cache_size=MAX_TOTAL)

    def rollout_func(prompts, trainer):
        g0 = time.perf_counter()
        engine = TorchEngine(trainer.model, sampling, hf_tok.pad_token_id)
        trainer.model.eval()
        eps, env = agent.rollout([agent.by_prompt[p] for p in prompts], engine, sandbox, 1, seed=10_000 + len(rows))
        trainer.model.train()
        gen.update(s=time.perf_counter() - g0, eps=eps, env=env)
        cut = [len(agent.chat.tokenizer.encode(p)) for p in prompts]
        return {"prompt_ids": [e.ids[:c] for e, c in zip(eps, cut)],
                "completion_ids": [e.ids[c:] for e, c in zip(eps, cut)],
                "logprobs": [e.sampler_logp[c:] for e, c in zip(eps, cut)],
                "env_mask": [e.loss_mask[c:] for e, c in zip(eps, cut)],
                "verifier_reward": [float(e.reward) for e in eps]}

    def reward(completions, verifier_reward=None, **kw):
        return list(verifier_reward)

    n = len(agent.prompts)
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=n * args.group,
                     num_generations=args.group, max_completion_length=MAX_TOTAL, temperature=1.0, top_p=1.0,
                     top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", num_iterations=1, learning_rate=args.lr,
                     lr_scheduler_type="constant", max_grad_norm=1e9, weight_decay=0.0, max_steps=args.iterations + 1,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                     gradient_checkpointing=False, seed=0, shuffle_dataset=False, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, processing_class=hf_tok,
                          train_dataset=Dataset.from_dict({"prompt": agent.prompts * (args.iterations + 2)}),
                          rollout_func=rollout_func)
    built = time.perf_counter() - t0
    clock = {}

    class Interleave(transformers.TrainerCallback):
        def on_step_begin(self, *a, **kw):
            clock["start"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            s = time.perf_counter() - clock["start"]
            rows.append({"trl": _row(gen["eps"], s, gen["s"], s - gen["s"], gen["env"]), "ours": ours.step()})

    trainer.add_callback(Interleave())
    trainer.train()
    return {"threads": threads, "build_s": built, "first_iteration_s": built + rows[0]["trl"]["s"], "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default=single.POLICY)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=2, help="timed iterations per TRL pass (after one warm-up)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", default="default,1")
    ap.add_argument("--settings", choices=("default", "rl_default", "study"), default="default",
                    help="the episode loop's settings, the same for both sides (module docstring)")
    ap.add_argument("--rows", choices=("packed", "shared", "whole"), default="packed",
                    help="our update's batch layout: packed for the model (TrajectoryConfig.pack_forward), a "
                         "group's prompt shared (share_prefix_min), or whole rows as TRL's")
    ap.add_argument("--out", default=None, help="default: results/vs_trl_agent[_<settings>].json")
    args = ap.parse_args(argv)
    args.out = args.out or os.path.join(HERE, "results", "vs_trl_agent.json" if args.settings == "default"
                                        else f"vs_trl_agent_{args.settings}.json")
    import torch

    from jaxrl_agent.env.sandbox import Sandbox
    from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES

    memo = MEMO_ENTRIES if args.settings in ("rl_default", "study") else 0
    with Sandbox(num_workers=2, memo_entries=memo) as ours_box, Sandbox(num_workers=2, memo_entries=memo) as trl_box:
        agent = Agent(args.policy, args.tasks, args.settings)
        t0 = time.perf_counter()
        ours = OursAgent(agent, args, ours_box)
        ours.step()
        first = time.perf_counter() - t0
        passes = [trl_agent_pass(agent, args, torch.get_num_threads() if th == "default" else int(th), ours, trl_box)
                  for th in args.threads.split(",")]
    return single.report({"config": vars(args), "cpus": os.cpu_count(), "ours_first_iteration_s": first,
                          "episodes": episodes_alike(passes), "environment": environment_floor(passes)},
                         passes, args.out, show=("environment",))


def environment_floor(passes: list[dict]) -> dict:
    """What the environment alone costs each side, and what that leaves a 4x iteration.

    `env_cpu_s`: CPU seconds of the sandbox's workers (tool calls and the verifier) in one
    rollout; on this machine's cores that is at least `env_cpu_s / cores` seconds of wall time
    whatever the engine, and the engine and the update share those same cores. So an iteration
    4x TRL's faster setting needs our sampling and update to fit in
    `trl_s / 4 - env_cpu_s / cores` (`left_for_engine_and_update_s`; negative: no engine can)."""
    rows = [r for p in passes for r in p["rows"]]
    cores = os.cpu_count()

    def med(side, k):
        vals = [r[side][k] for r in rows if r[side].get(k) is not None]
        return float(np.median(vals)) if vals else None

    out = {side: {k: med(side, k) for k in ("env_cpu_s", "sampling_s")} for side in ("ours", "trl")}
    trl_s = min(single.steady(p["rows"], "trl")["s"] for p in passes)
    env = out["ours"]["env_cpu_s"]
    out["cores"], out["trl_best_s"], out["target_4x_s"] = cores, trl_s, trl_s / 4
    if env is not None:
        out["env_floor_s"] = env / cores
        out["left_for_engine_and_update_s"] = trl_s / 4 - env / cores
    return out


def episodes_alike(passes: list[dict]) -> dict:
    """Both sides' mean success and turns over the timed iterations: the ratios compare like
    work only if these agree (the same policy and loop, sampled apart). A TRL side that lost
    its own turns once showed success 0.00 in ~10 turns against our ~0.5 in ~6."""
    rows = [r for p in passes for r in p["rows"]]
    sides = {side: {k: float(np.mean([r[side][k] for r in rows])) for k in ("success", "turns")}
             for side in ("ours", "trl")}
    if abs(sides["ours"]["turns"] - sides["trl"]["turns"]) > 0.25 * sides["ours"]["turns"]:
        print(f"WARNING: the two sides' episodes differ ({sides}): the time ratios do not compare like work")
    return sides


if __name__ == "__main__":
    from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    main()
