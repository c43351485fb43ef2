"""Frozen dataclass configs of the training path (loss, sampling, trajectory, mesh, optimizer,
LoRA, train step, checkpoints, rollout, RL loop, rewards): one docstring per field, no logic.
The other configs live beside the code they configure (ARCHITECTURE.md, "One home per rule").

Each function receives only the sub-config it needs (DESIGN §10). CLI overrides address
fields with dotted names, e.g. `--loss.clip_high=0.28`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossConfig:
    """Everything a registered `LossFn` may read. Unused fields are ignored by a loss."""

    agg: str = "token-mean"
    """Loss aggregation mode (see `losses.aggregate`)."""
    clip_low: float = 0.2
    """PPO lower clip: ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO upper clip: ratio is clipped at 1 + clip_high (DAPO clip-higher uses 0.28)."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c for negative advantages (None disables it)."""
    tis_cap: float | None = None
    """Truncated importance sampling cap for exp(old_logp - sampler_logp); None disables TIS."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term (0 disables it; needs `ref_logp`)."""
    kl_kind: str = "k3"
    """KL estimator for the loss term: k1/kl, abs, k2/mse, k3/low_var_kl."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    vf_coef: float = 0.5
    """Weight of the value loss (only when the policy has a value head)."""
    cliprange_value: float | None = 0.2
    """Value clipping range around `old_values` (None disables value clipping)."""
    gamma: float = 1.0
    """Discount per policy token (GAE, REINFORCE++)."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Whiten token-level advantages over the batch (PPO with GAE)."""
    norm_by_std: bool = True
    """GRPO: divide by the group std (False is Dr.GRPO)."""
    gspo_clip_low: float = 3e-4
    """GSPO lower clip of the sequence-level ratio."""
    gspo_clip_high: float = 4e-4
    """GSPO upper clip of the sequence-level ratio."""
    cispo_clip_high: float = 5.0
    """CISPO upper clip of the (stop-gradient) IS weight; CISPO uses no lower clip by default."""
    cispo_clip_low: float | None = None
    """CISPO lower clip of the IS weight (None: no lower clip)."""
    dpo_beta: float = 0.1
    """DPO inverse temperature beta."""
    dpo_kind: str = "sigmoid"
    """DPO variant: "sigmoid" (DPO) or "ipo"."""
    dpo_label_smoothing: float = 0.0
    """Conservative DPO label smoothing epsilon (sigmoid kind only)."""
    rm_margin: float = 0.0
    """Bradley-Terry reward model: the chosen score must beat the rejected one by this margin."""
    rm_label_smoothing: float = 0.0
    """Bradley-Terry label smoothing epsilon: the weight given to the pair being mislabelled."""


@dataclass(frozen=True)
class SamplingConfig:
    """The sampling engine (`sampling/decode.py`, `sampling/engine.py`). Hashable: the jitted decode
    loop takes it as a static argument, so changing a field compiles a new loop."""

    temperature: float = 1.0
    """Softmax temperature of the sampling distribution; 0.0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling (0 disables top-k)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (after top-k)."""
    max_new_tokens: int = 256
    """Most tokens sampled per turn (also the static length of the decode output buffer)."""
    stop_token_ids: tuple[int, ...] = ()
    """Default per-row stop set (e.g. <|im_end|>, </tool_call>); a sampled stop token ends the turn and is kept."""
    max_stop_tokens: int = 4
    """Width of the per-row stop-token table (a row's stop set may hold at most this many ids)."""
    batch_size: int = 8
    """Rows of the engine: independent episodes sampled together."""
    cache_size: int = 2048
    """S, KV-cache slots per row: the longest episode (prompt + all turns) a row can hold."""
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    """Allowed prefill chunk lengths; a chunk is padded up to the smallest bucket that fits."""
    prefill_row_buckets: tuple[int, ...] = ()
    """Allowed row counts of one prefill call: the rows with text to prefill are padded up to
    the smallest that fits (batch_size is always allowed). Empty: 1, ceil(B/4), B."""
    decode_row_buckets: tuple[int, ...] = ()
    """Allowed row counts of one decode loop: the rows in a turn are gathered into the smallest
    that holds them (with rows that stand still), decoded, and written back, so a step costs
    the rows that decode, not B (`sampling.generate`'s rows; batch_size is always allowed). Empty:
    the prefill row buckets when those are given, else ceil(B/4), ceil(B/2), B. (batch_size,)
    decodes every call on all B rows."""
    seed: int = 0
    """Base PRNG seed; a row's stream is also keyed by its episode seed and token position."""
    share_prefix_min: int = 32
    """`start_episode` copies the longest prompt prefix that some row's cache already holds
    (its previous episode's or another row's: a GRPO group's episodes share one prompt, every
    episode the system prompt), if it is at least this many tokens, instead of prefilling
    it; only the rest is prefilled. 0 disables (every prompt is prefilled whole)."""
    decode_window: int = 256
    """Decode steps attend to the first W, 2W, ... cache slots (the smallest multiple of W
    past every live row's length) instead of all S, so attention costs what the episodes
    hold, not what the cache could hold. Compiles one decode loop per multiple, ceil(S / W)
    in all; 0 attends to all S slots in one loop."""


# ---- trainer configs (trajectory.py, train/: sharding.py, step.py, lora.py, checkpoint.py) ----
@dataclass(frozen=True)
class TrajectoryConfig:
    """How `trajectory.collate` turns episodes into a padded `TrainBatch`."""

    buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    """Allowed padded lengths T; a batch is padded to the smallest bucket that fits it."""
    batch_multiple: int = 1
    """Pad the row count B up to a multiple of this (data * fsdp devices) with empty rows."""
    overflow: str = "error"
    """An episode longer than the largest bucket: "error" (reject) or "truncate" (keep the
    first max-bucket tokens and record the reason in `CollateInfo.truncated`)."""
    pack: bool = False
    """Pack several short episodes into one row (segment ids in attention_mask, positions
    restarting per segment). For token-level losses (SFT) only: RL losses read one reward
    and one group per row."""
    pad_id: int = 0
    """Token id written on padding positions (never attended to, never in a loss)."""
    row_buckets: tuple[int, ...] = ()
    """Allowed row counts B (multiples of batch_multiple), so a varying number of episodes
    compiles a bounded number of shapes; empty: any multiple of batch_multiple."""
    share_prefix_min: int | None = None
    """Rows of one group (`Episode.group_id`) whose episodes begin with the same tokens, more
    than this many and none of them a loss token (a GRPO group's prompt), train on that
    prefix once: it goes to `TrainBatch.prefix_tokens` and each row keeps the rest, so the
    forward and backward passes run the prompt once per group instead of once per row (the
    gradient is the same up to float summation order). It pays when a prompt is a large part
    of each row and a batch is one update (benchmarks/bench_vs_trl.py); with mini-batches every
    mini-batch runs every prefix and its rows' queries attend to the padded prefix, which costs
    more than it saves, as it does when the rows stay in the same length bucket. 0 pads every
    episode whole (ignored with `pack`); None: whole rows, except in the RL loop, which shares
    (32) when a batch is one update (num_mini_batches 1) and the cut moves the longest episode
    its budget allows to a smaller bucket (`loops.rollout_batches.rollout_batch_config`)."""
    prefix_buckets: tuple[int, ...] = ()
    """Allowed prefix lengths Tp; empty: `buckets`."""
    prefix_rows: tuple[int, ...] = ()
    """Allowed prefix counts P (multiples of batch_multiple): a run whose groups vary in
    number compiles one shape; empty: the smallest multiple of batch_multiple that fits."""
    pack_forward: bool = False
    """Rows stay one episode each (what an RL loss reads), but the model runs them packed:
    `collate` also writes the episodes first-fit-decreasing into rows of T tokens
    (`TrainBatch.pack_tokens`, segment ids, positions restarting) and `pack_slot` says where
    each row's tokens went, so the forward and backward passes skip the padding between
    episodes of unequal length; the outputs are read back per row (equal to the whole rows'
    up to float summation order). Pays when lengths vary and a batch is one update and one
    micro-batch (each mini- or micro-batch runs every packed row): benchmarks/bench_update_layouts.py.
    Not with `pack` or `share_prefix_min`, nor across processes; the RL loop precompiles the
    smallest packed shape, others compile when a batch first needs them (`pack_rows` bounds them)."""
    pack_rows: tuple[int, ...] = ()
    """Allowed packed row counts (multiples of batch_multiple) with `pack_forward`, so batches
    of varying lengths compile a bounded number of shapes; empty: the smallest multiple of
    batch_multiple that fits."""


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh with axes ("data", "fsdp", "tensor") and the parameter sharding preset."""

    data: int = -1
    """Data-parallel axis size; -1 takes every device not used by fsdp * tensor."""
    fsdp: int = 1
    """Fully-sharded data-parallel axis size (parameters and batch both split over it)."""
    tensor: int = 1
    """Tensor-parallel axis size (heads / mlp / vocab split over it)."""
    preset: str = "dp"
    """Parameter sharding preset: "dp" (replicated), "fsdp", "fsdp+tp"."""
    max_replicated_fraction: float = 0.05
    """Under an fsdp preset, fail if more than this fraction of parameter bytes is replicated."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm gradient clipping and a learning-rate schedule."""

    learning_rate: float = 1e-5
    """Peak learning rate."""
    schedule: str = "constant"
    """"constant", "linear" (decay to min_lr_ratio * peak) or "cosine"; all after warmup."""
    warmup_steps: int = 0
    """Linear warmup from 0 over this many optimizer steps."""
    total_steps: int = 1000
    """Length of the decay schedule in optimizer steps (linear / cosine)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak (linear / cosine)."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None disables clipping)."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the attention and MLP projections; rank 0 disables LoRA."""

    rank: int = 0
    """Adapter rank r (0: train every parameter)."""
    alpha: float = 16.0
    """Scale: W_eff = W + (alpha / r) A B."""
    targets: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    """Projection weights that get an adapter."""
    init_std: float | None = None
    """Std of A's normal init (None: 1 / sqrt(fan_in)); B starts at 0, so W_eff = W at init."""


@dataclass(frozen=True)
class TrainConfig:
    """One rollout batch -> several optimizer updates (`train_step.make_train_step`)."""

    loss: LossConfig = LossConfig()
    """Handed to the LossFn unchanged."""
    mesh: MeshConfig = MeshConfig()
    """Device mesh and parameter sharding preset."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters (rank 0: full fine-tuning)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch."""
    num_mini_batches: int = 1
    """Optimizer updates per epoch; the batch is split into this many mini-batches."""
    shuffle: bool = True
    """Permute rows (with the state's RNG) before each epoch's mini-batch split."""
    num_micro_batches: int = 1
    """Gradient accumulation: micro-batches per mini-batch (exactly the full mini-batch gradient)."""
    old_logp: str = "sampler"
    """Where `old_logp` comes from when the batch has none: "sampler" (sampler_logp) or
    "recompute" (the trainer's log-probs before the first update)."""
    use_ref: bool = False
    """Fill `ref_logp` from the frozen reference policy (initial params, or the LoRA base)."""
    advantage: str = "loss"
    """"loss": the loss's own estimator (`losses.registry.LOSS_ADVANTAGES`), computed once over
    the whole rollout batch before a mini-batch split (every estimator couples rows: groups, or
    whitening over the batch) and inside the loss when there is no split. "grpo", "dr_grpo",
    "rloo", "gae", "reinforce_pp": that estimator, computed once on device over the whole batch.
    A LossFn of your own reads `batch.advantages` (and `batch.returns`) when one is named here."""
    logp_chunk_size: int = 64
    """Sequence chunk of the log-prob / entropy path (memory O(B * chunk * V))."""
    remat: bool = False
    """Recompute each decoder layer in the backward pass instead of keeping its activations
    (gradient checkpointing; `ModelConfig.remat` on the step's model, whose layers then run in
    a scan): much less scratch for about one more forward pass (`benchmarks/update_cost.py
    --remat`). A model whose own config has remat on uses it either way."""
    logp_loss_chunks_only: bool = True
    """Compute logits only in the chunks where some row has a loss position (`loss_mask`):
    every loss reads log-probs there alone, so the step's results are exactly the same with
    fewer logits (`logprobs.token_logprobs_and_entropy(mask=)`). With a batch sharded over
    devices each chunk's test is a small all-reduce. Off on a CPU mesh of several devices,
    where a collective inside the skip's `lax.cond` can deadlock
    (`train.sharding.control_flow_may_hold_collectives`). False computes every chunk."""
    compiler_options: tuple[tuple[str, str | int | bool], ...] = ()
    """XLA options for the step's jits as (name, value) pairs, e.g.
    (("xla_backend_optimization_level", 0),) halves CPU compile time (tests)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """orbax checkpointing (train/checkpoint.py)."""

    directory: str = "checkpoints"
    """Root directory; one sub-directory per saved step."""
    max_to_keep: int = 3
    """Keep the last N checkpoints."""
    save_every: int = 100
    """Save every this many training steps (the loops also save at the end)."""


# ---- the agent loop (agent/rollout.py, loops/rl.py) ----
SYSTEM_PROMPT = ("You fix bugs in a small Python repository. Call one tool per message. "
                 "Read the code, fix it, run the tests, then submit.")


@dataclass(frozen=True)
class RolloutConfig:
    """The host agent loop (`collect_episodes`)."""

    group_size: int = 8
    """Episodes per task (the GRPO / RLOO group)."""
    max_total_tokens: int = 1024
    """Token budget of one episode (prompt + all turns); past it the episode ends "max_tokens"."""
    max_tokens_per_turn: int = 96
    """Most tokens the policy may sample in one assistant message."""
    decode_chunk: int = 16
    """Decode steps per engine call: a row whose turn ends is handed to its tools at the next
    chunk boundary while the other rows go on decoding, so rows do not wait for the batch's
    longest turn (benchmarks/bench_rollout.py). 0: whole turns, one engine call each."""
    tool_threads: int = 8
    """Threads running tool calls and verifications concurrently with decoding."""
    system_prompt: str = SYSTEM_PROMPT
    """System message; the tool list is appended in the chat format's tool style."""
    drop_terminations: tuple[str, ...] = ("sandbox_error",)
    """Episodes ending this way are returned but excluded from the update (`trainable`)."""
    filter_zero_variance: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no GRPO signal)."""
    verify_test_timeout_s: float = 1.0
    """Per-test CPU-time limit (seconds) of the verifier's hidden-test run (`verify`'s
    `test_timeout_s`; 1.0 is `verifier.TEST_TIMEOUT_S`). A submission that loops pays it on
    every episode it ends, on the cores the sampler needs: families whose tests run in
    microseconds set it lower (the binary-search study uses its `test_timeout_s`,
    benchmarks/bench_verify_limit.py). Lower is only stricter: a test over the limit fails."""


@dataclass(frozen=True)
class RLConfig:
    """The RL loop (loops/rl.py): what to train on, how often to evaluate, log and checkpoint."""

    algo: str = "grpo"
    """Registered loss (jaxrl_agent.losses.LOSSES): grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp, ppo."""
    iterations: int = 20
    """Rollout-then-update iterations."""
    tasks_per_iter: int = 4
    """Tasks per iteration (each gets `rollout.group_size` episodes)."""
    train_split: str = "train"
    """Task split trained on."""
    num_train_tasks: int = 256
    """Size of the generated training task pool (iterated in a seeded, resumable order)."""
    eval_split: str = "heldout_instances"
    """Held-out split evaluated before training and every `eval_every` iterations."""
    eval_tasks: int = 16
    """Held-out tasks per evaluation."""
    eval_samples: int = 4
    """Episodes per held-out task (pass@k uses k = this)."""
    train_file: str = ""
    """JSONL task file (`env.tasks.save_tasks` format) to train on instead of `train_split` /
    `num_train_tasks`; every task is checked in the sandbox first (`verifier.check_task`)."""
    eval_file: str = ""
    """JSONL task file evaluated instead of `eval_split` / `eval_tasks` (checked the same way)."""
    eval_every: int = 10
    """Evaluate every this many iterations (0: only before and after)."""
    before_eval: str = "start"
    """When the held-out evaluation of the starting policy (result["before"]) runs: "start",
    before the first iteration (verl's val_before_train), or "end", after the last one, on the
    starting params the run keeps (one more copy of the engine's params): the same episodes
    and figures, and the first iteration comes one evaluation sooner. A run that stops for
    want of signal (`NoSignalError`) evaluates it before it stops either way."""
    keep_best: bool = False
    """Also export, as `<run_dir>/best_policy`, the policy of the evaluation after training
    began (every `eval_every` and the last) with the best pass@1; ties go to the later one.
    Early stopping chosen on the evaluation split, so that split must not be a held-out set
    whose figures are reported; `train_rl`'s result["best"] says which iteration it is."""
    shuffle_rewards: bool = False
    """Control run: permute rewards across the batch's episodes before the update."""
    require_signal: bool = True
    """Refuse to train when the starting policy's pass@k on training tasks is 0 (no signal)."""
    seed: int = 0
    """Seed of task order, episode sampling and initialisation."""
    run_dir: str = "runs/rl"
    """Metrics (metrics.jsonl, TensorBoard), checkpoints and the final policy go here."""
    checkpoint_every: int = 10
    """Checkpoint every this many iterations (and at the end / on Ctrl-C)."""
    sandbox_workers: int = 2
    """Sandbox worker processes for run_tests and the verifier (per process of a multi-host job)."""
    sandbox_memo: bool = True
    """Identical sandbox calls (the same workspace bytes, command and limits) share one
    execution (`env.sandbox_memo`): in an RL batch most `run_tests` and verifier calls repeat
    one another (a group's episodes test the same untouched code and end with the same fix).
    False for tasks whose tests depend on chance or the clock, to draw them anew each call."""
    max_staleness: int = 0
    """0: synchronous (each iteration's rollouts use the policy its update starts from). 1:
    one-step-off-policy: the next iteration's rollouts run on the previous policy while the
    update runs: the PPO ratio is taken against the trainer's recomputed log-probs
    (`train.old_logp="recompute"`, forced) and truncated IS corrects for the sampler's
    (`train.loss.tis_cap`, 2.0 when unset; `train/tis_*` metrics). Each episode records the
    policy version that sampled it (`rollout/staleness_*`)."""
    precompile: bool = True
    """Compile the train step for every length bucket in a background thread
    (`TrainStep.precompile`), so the first update does not wait for its compile: the smaller
    buckets at once, the top one (the slowest) when an episode of the first rollout needs it,
    else once the first iteration is done."""


@dataclass(frozen=True)
class RewardConfig:
    """What the RL loop trains on (`rewards.RewardComposer`): the verifier's outcome, a frozen
    reward model's score, or a weighted sum, plus optional per-turn shaped rewards. The
    defaults are the verifier alone with no shaping (the loop's behaviour without this config)."""

    source: str = "verifier"
    """"verifier" (the 0/1 outcome), "reward_model" (the reward model's score alone) or
    "sum" (verifier_weight * verifier + reward_model_weight * reward model)."""
    reward_model_path: str = ""
    """HF directory of a reward model (`python -m jaxrl_agent rm-train`); needed unless source
    is "verifier"."""
    verifier_weight: float = 1.0
    """Weight of the verifier's reward in "sum"."""
    reward_model_weight: float = 1.0
    """Weight of the reward model's (normalised, clipped) score in "sum" and "reward_model"."""
    normalize: bool = False
    """Standardise the reward model's score with the running mean / std of every score seen
    so far in the run (checkpointed with it)."""
    clip: float | None = None
    """Clip the (normalised) reward model score to [-clip, clip] (None: no clipping)."""
    interface_error_penalty: float = 0.0
    """Per-turn shaped reward (use a negative value) on a turn whose call never reached a tool
    (malformed call, unknown tool, bad arguments); placed on that turn's last policy token."""
    tool_error_penalty: float = 0.0
    """Per-turn shaped reward on a turn whose tool call was legal but failed (missing file,
    `old` text not found or not unique)."""
    repeated_test_penalty: float = 0.0
    """Per-turn shaped reward on a `run_tests` call with no successful edit since the previous
    test run: its result cannot differ, so it cannot change the outcome."""
    unchanged_edit_penalty: float = 0.0
    """Per-turn shaped reward on an edit that changed nothing (the lines already held its
    text, `StepResult.changed` False): the turn that loops on a correct line."""
    pairs_out: str = ""
    """Append the preference pairs each iteration's rollouts yield (two episodes of one task
    whose verifier rewards differ) to this JSONL file, the input of `rm-train` ("" = off)."""
    score_batch_size: int = 16
    """Episodes per reward-model scoring call (the rows of its one compiled shape per bucket)."""
