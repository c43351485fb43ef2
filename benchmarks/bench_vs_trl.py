"""One whole GRPO iteration side by side: ours (jitted sampling engine + sharded train step)
against TRL's `GRPOTrainer` (the library a PyTorch user picks), in one process, on the same
weights and the same prompt ids, iteration by iteration.

    python benchmarks/bench_vs_trl.py [--iterations=4] [--policy=DIR]   -> benchmarks/results/vs_trl.json

Workload (single turn): `--prompts` task prompts of the bug-fixing tasks (the agent's first
turn, ~220 tokens) x `--group` completions each, temperature 1, no top-k / top-p, up to
`--new` new tokens, stopping on the policy's stop tokens; reward: a rule on the completion
text, equal on both sides (its parity of length), so groups have mixed rewards and the update
is a real one; float32 on both sides (TRL's defaults, bf16 autocast and gradient checkpointing,
are turned off unless `--trl_defaults`: our side does neither, and bf16 matmuls on a CPU
without bf16 units are several times slower); one GRPO update over all completions: token-mean
over the batch (TRL's "dapo"), clip 0.2, AdamW, no KL, one update per batch. Both sides
compute the same loss and gradient; ours runs a group's shared prompt through the forward and
backward passes once (`TrajectoryConfig.share_prefix_min`, which the RL loop turns on when a
batch is one update), TRL once per completion; `--whole_rows` turns it off.

Interleaving: TRL's own training loop runs (`trainer.train()`), and a callback runs one of our
iterations after each of TRL's steps, so background load hits both alike. TRL runs twice,
at torch's default thread count and at one thread (on a small model one thread can be
faster), and the headline ratio is against the faster. Each side's iteration is split into
generation and update: ours by its two calls; TRL's by timing its `_generate_single_turn`
(prompt prefill + decode), the rest of the step (log-probs, advantages, loss, backward,
AdamW) being its update. The time to the first iteration counts everything from loading
the policy (ours: the engine and train-step compiles, no persistent cache; TRL: building the
trainer) to the end of the first iteration. Steady-state figures leave the first iteration out.

The process runs with tcmalloc preloaded when the machine has it, as `python -m jaxrl_agent`
does (jaxrl_agent/cli/malloc_env.py); torch shares the process and the allocator.

Before timing, the sides are checked to be on the same numbers: the prompt ids TRL tokenized
equal ours, and the log-probs both policies give one completion agree.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
POLICY = os.path.join(ROOT, "jaxrl_agent", "assets", "demo_policy")


def reward_rule(text: str) -> float:
    """The same on both sides: mixed rewards in every group, no verifier in the timing."""
    return float(len(text) % 2)


def task_prompts(tok, n: int) -> tuple[list[str], list[list[int]]]:
    """The agent's first-turn prompt (system + tools + task) of `n` training tasks, as text and ids."""
    from jaxrl_agent.agent.rollout import episode_prompt
    from jaxrl_agent.config import RolloutConfig
    from jaxrl_agent.env.tasks import generate_tasks
    from jaxrl_agent.tokenizer import ChatFormat, EpisodeBuilder

    chat = ChatFormat(tok, tool_style="short")
    texts, ids = [], []
    for task in generate_tasks("train", n, seed=0):
        b = EpisodeBuilder(chat, episode_prompt(task, RolloutConfig().system_prompt), chat.tool_schemas)
        texts.append(b._text)
        ids.append(list(b.ids))
    return texts, ids


class Ours:
    """Our GRPO iteration: every completion in one engine batch, one turn, collate, one update."""

    def __init__(self, policy: str, args, prompt_ids: list[list[int]]):
        t0 = time.perf_counter()
        from jaxrl_agent.agent.policy import load_policy
        from jaxrl_agent.config import LossConfig, OptimConfig, SamplingConfig, TrainConfig, TrajectoryConfig
        from jaxrl_agent.losses.registry import LOSSES
        from jaxrl_agent.sampling.engine import SamplingEngine
        from jaxrl_agent.train.step import make_optimizer, make_train_step
        from jaxrl_agent.train.weight_sync import policy_for_engine, sync_engine

        self.model, self.tok = load_policy(policy)
        self.prompt_ids, self.group, self.rows = prompt_ids, args.group, len(prompt_ids) * args.group
        longest = max(map(len, prompt_ids)) + args.new
        self.ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=args.lr)),
                                  TrainConfig(loss=LossConfig(agg="token-mean", clip_low=0.2, clip_high=0.2,
                                                              kl_coef=0.0)),
                                  self.model)
        self.state = self.ts.init_state(self.model, seed=0)
        # length buckets every 64 tokens: a batch pads to its longest row, as TRL's does; a
        # group's shared prompt trains once, padded to a multiple of 32 (0 with --whole_rows)
        self.traj = TrajectoryConfig(buckets=tuple(range(64, longest + 64, 64)),
                                     prefix_buckets=tuple(range(32, longest + 32, 32)),
                                     share_prefix_min=0 if args.whole_rows else 32,
                                     batch_multiple=self.ts.mesh.devices.size)
        self.engine = SamplingEngine(policy_for_engine(self.ts, self.state), SamplingConfig(
            temperature=1.0, max_new_tokens=args.new, batch_size=self.rows, cache_size=self.traj.buckets[-1],
            stop_token_ids=tuple(self.tok.stop_ids),
            # the longest prompt, and 32 for the tail of a prompt whose prefix a group member's
            # row already holds (SamplingConfig.share_prefix_min)
            prefill_buckets=tuple(sorted({32, -(-max(map(len, prompt_ids)) // 32) * 32}))))
        self._sync_engine = sync_engine
        self.setup_s = time.perf_counter() - t0
        self.iteration = 0

    def step(self) -> dict:
        from jaxrl_agent.trajectory import Episode, collate

        t0 = time.perf_counter()
        for r in range(self.rows):
            self.engine.start_episode(r, self.prompt_ids[r // self.group], seed=self.iteration * self.rows + r)
        turn = self.engine.sample_turn()
        episodes = []
        for r in range(self.rows):
            ids, logp, _ = turn.row(r)
            p = self.prompt_ids[r // self.group]
            episodes.append(Episode(list(p) + list(ids), [0] * len(p) + [1] * len(ids), [0.0] * len(p) + list(logp),
                                    [0] * (len(p) + len(ids)), reward=reward_rule(self.tok.decode(ids)),
                                    group_id=r // self.group))
            self.engine.end_episode(r)
        t1 = time.perf_counter()
        if self.iteration == 0:
            self.first_episode = episodes[0]
        batch = collate(episodes, self.traj)[0]
        self.state, metrics = self.ts(self.state, batch)
        self._sync_engine(self.engine, self.ts, self.state)
        float(metrics["loss"])
        t2 = time.perf_counter()
        self.iteration += 1
        new = int(turn.num_new.sum())
        return {"s": t2 - t0, "generation_s": t1 - t0, "update_s": t2 - t1, "new_tokens": new,
                "tokens": new + sum(len(p) for p in self.prompt_ids) * self.group}


def trl_pass(policy: str, args, texts: list[str], prompt_ids: list[list[int]], threads: int, ours: Ours | None,
             ours_first: dict) -> dict:
    """One `GRPOTrainer.train()` of `iterations + 1` steps at `threads` torch threads; after each
    of its steps, one of our iterations (when `ours` is given)."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    stop = [int(i) for i in ours_first["stop_ids"]]
    model.generation_config.eos_token_id = stop
    model.generation_config.pad_token_id = tok.pad_token_id
    n = len(texts)
    data = Dataset.from_dict({"prompt": texts * (args.iterations + 2)})
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=n * args.group,
                     num_generations=args.group, max_completion_length=args.new, temperature=1.0, top_p=1.0, top_k=0,
                     beta=0.0, epsilon=0.2, loss_type="dapo", num_iterations=1, learning_rate=args.lr,
                     lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1e9, weight_decay=0.0,
                     max_steps=args.iterations + 1, logging_steps=1, report_to=[], save_strategy="no",
                     use_cpu=True, **({} if args.trl_defaults else {"bf16": False, "gradient_checkpointing": False}),
                     seed=0, shuffle_dataset=False, disable_dropout=True, log_completions=False)
    rows: list[dict] = []
    seen_prompts: list = []
    gen = {"s": 0.0, "new": 0}

    def reward(completions, **kw):
        return [reward_rule(c) for c in completions]

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=data, processing_class=tok)
    inner = trainer._generate_single_turn

    def timed(prompt_ids_, *a, **kw):
        g0 = time.perf_counter()
        out = inner(prompt_ids_, *a, **kw)
        gen["s"] += time.perf_counter() - g0
        gen["new"] += sum(len(c) for c in out[0])
        seen_prompts.extend(list(map(list, prompt_ids_)))
        return out

    trainer._generate_single_turn = timed
    clock = {"start": None}
    built = time.perf_counter() - t0

    class Interleave(transformers.TrainerCallback):
        def on_step_begin(self, *a, **kw):
            gen["s"], gen["new"] = 0.0, 0
            clock["start"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            s = time.perf_counter() - clock["start"]
            rows.append({"trl": {"s": s, "generation_s": gen["s"], "update_s": s - gen["s"], "new_tokens": gen["new"],
                                 "tokens": gen["new"] + sum(map(len, prompt_ids)) * args.group}})
            if ours is not None:
                rows[-1]["ours"] = ours.step()

    trainer.add_callback(Interleave())
    trainer.train()
    uniq = {tuple(p) for p in seen_prompts}
    same = uniq <= {tuple(p) for p in prompt_ids}
    return {"threads": threads, "build_s": built, "first_iteration_s": built + rows[0]["trl"]["s"], "rows": rows,
            "prompt_ids_equal": bool(same)}


def logp_agreement(ours: Ours, policy: str) -> float:
    """Max |log-prob| difference, on the policy tokens of our first sampled episode, between the
    log-probs our sampler reported (the weights on disk, before any update) and transformers'
    forward of the same weights."""
    import torch
    import transformers

    ep = ours.first_episode
    seq = np.asarray([ep.ids], np.int64)
    mask = np.asarray(ep.loss_mask, bool)
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.from_numpy(seq.astype(np.int64))).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(seq[0, 1:, None]))[:, 0].numpy()
    mine = np.asarray(ep.sampler_logp)
    return float(np.abs(mine[1:][mask[1:]] - theirs[mask[1:]]).max())


def steady(rows: list[dict], side: str) -> dict:
    keep = rows[1:] or rows
    out = {k: float(np.median([r[side][k] for r in keep])) for k in ("s", "generation_s", "update_s")}
    out["new_tokens_per_s"] = float(np.sum([r[side]["new_tokens"] for r in keep]) /
                                    np.sum([r[side]["generation_s"] for r in keep]))
    out["tokens_per_s"] = float(np.sum([r[side]["tokens"] for r in keep]) / np.sum([r[side]["s"] for r in keep]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default=POLICY)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=4, help="timed iterations per TRL pass (after one warm-up)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", default="default,1", help="torch thread settings of TRL's passes")
    ap.add_argument("--trl_defaults", action="store_true",
                    help="keep GRPOConfig's bf16 autocast and gradient checkpointing (what a user gets)")
    ap.add_argument("--whole_rows", action="store_true",
                    help="our update runs every row's prompt (no shared prefixes), as TRL's does")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vs_trl.json"))
    args = ap.parse_args(argv)
    import torch

    from jaxrl_agent.tokenizer import load_tokenizer

    texts, prompt_ids = task_prompts(load_tokenizer(args.policy), args.prompts)
    t0 = time.perf_counter()
    ours = Ours(args.policy, args, prompt_ids)
    first = ours.step()
    ours_first = {"first_iteration_s": time.perf_counter() - t0, "setup_s": ours.setup_s, "first": first,
                  "stop_ids": list(ours.tok.stop_ids)}
    gap = logp_agreement(ours, args.policy)
    passes = []
    for th in args.threads.split(","):
        n = torch.get_num_threads() if th == "default" else int(th)
        passes.append(trl_pass(args.policy, args, texts, prompt_ids, n, ours, ours_first))
        print(f"TRL at {n} threads: {steady(passes[-1]['rows'], 'trl')}", flush=True)
    res = {"config": vars(args), "cpus": os.cpu_count(), "logp_max_abs_diff": gap,
           "prompt_tokens_mean": float(np.mean([len(p) for p in prompt_ids])),
           "ours_first_iteration_s": ours_first["first_iteration_s"]}
    return report(res, passes, args.out, extra=("prompt_ids_equal",), show=("logp_max_abs_diff",))


def report(res: dict, passes: list[dict], out: str, extra: tuple = (), show: tuple = ()) -> dict:
    """Steady-state figures of both sides, TRL per thread setting (plus each pass's `extra`
    keys), the ratios against TRL's faster setting; written to `out` and printed."""
    res = {**res, "passes": passes, "ours": steady([r for p in passes for r in p["rows"]], "ours"), "trl": {}}
    for p in passes:
        res["trl"][f"threads_{p['threads']}"] = {**steady(p["rows"], "trl"),
                                                 "first_iteration_s": p["first_iteration_s"], **{k: p[k] for k in extra}}
    best = min(res["trl"], key=lambda k: res["trl"][k]["s"])
    res["trl_best"] = best
    res["speedup_vs_trl_best"] = {k: res["trl"][best][k] / res["ours"][k] for k in ("s", "generation_s", "update_s")}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: res[k] for k in (*show, "ours", "trl", "speedup_vs_trl_best", "ours_first_iteration_s")},
                     indent=2))
    return res


if __name__ == "__main__":
    from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # both sides' large temporaries (jaxrl_agent/cli/malloc_env.py), as the CLI runs
    main()
