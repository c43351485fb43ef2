"""The study's configuration: one frozen dataclass per stage, one docstring per field.

The defaults are the CPU study (2 cores, about 90 minutes). `GPU_PRESET` is the documented
larger setting for one accelerator; select it with `--preset=gpu`, then override fields with
`--section.field=value` as in the main CLI.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from jaxrl_agent.agent.policy import TinyModelConfig
from jaxrl_agent.tokenizer import TOKENIZER_MODES


@dataclass(frozen=True)
class DemoStage:
    """Scripted-expert demonstrations on the train split (one expert style per task)."""

    num_tasks: int = 2000
    """Distinct training tasks demonstrated; many distinct instances is what lets a tiny policy
    generalise to held-out instances instead of memorising a few. 2000 with 1500 SFT steps
    (6 passes) was chosen on the gate's validation instances: pass@1 0.562 against 0.359 with
    600 and 600 steps (8 passes); 2000 at 600 steps (2.4 passes) had been worse (README)."""
    style_weights: tuple[float, ...] = (0.35, 0.15, 0.2, 0.0, 0.0, 0.1, 0.1, 0.1)
    """Sampling weights of the expert styles perfect, skip_tests, first_bug_only,
    wrong_first_edit, stop_after_failure, rerun_tests, recover_after_failing_run,
    stop_after_failing_run (env/expert.py `STYLES`). Every imperfection is a decision (stop
    after one fix, stop after a failing run, submit without testing, re-run instead of
    editing) and every edit made is right: the two wrong-edit styles are off, their recovery
    and stop demonstrated by the last two styles instead. Chosen on the gate's validation
    instances: pass@1 0.359 and 41% of the failures sequential, against 0.344 and 36% with
    the wrong-edit styles at 0.1 each (README at the root). On the canonical task, whose dev
    tests reveal one of its two bugs, only perfect and skip_tests succeed: 50% of the
    demonstrations, so SFT on all of them imitates a policy that fails there about half the
    time, and the verifier pays for what the demonstrations teach only sometimes."""
    made_up_modules: float = 0.5
    """Share of demonstration tasks whose file gets a made-up name (`drills.module_renamed_tasks`):
    the expert lists the files, then reads and edits the one listed, so the path in every later
    call is a copy of the listing, never a pool name to remember. 0.5 (with the drills' same
    share) was chosen on 32 validation instances x 4 re-made with a made-up file name: the SFT
    policy's pass@1 0.000 at 0 -> 0.516, while the same instances with pool names stay level
    (0.594 -> 0.562) (README, "Tasks written by hand")."""
    word_modules: float = 0.5
    """Share of those made-up file names that are English words instead of syllables
    (`drills._word_name`: standard-library module names joined to another or to a helper
    suffix, the training half of the words), as a user's files are named. At 0.5 for both
    stages the SFT policy solves 0.180 of 32 validation instances x 4 with English-word names
    from the other half (0.000 at 0; paired +0.180 [+0.070, +0.297]) and stays level on the
    made-up-name and natural ones (one run); the whole study at 0.5 is the one in
    results/summary.json (README, "Tasks written by hand")."""


@dataclass(frozen=True)
class PretrainStage:
    """Edit drills (drills.py) on fresh train-split instances, from a randomly initialised
    model: the copy skill the demonstrations are too few to teach. 0 steps skips it."""

    num_tasks: int = 4000
    """Distinct drill instances (generated with seed + 100, disjoint from the demonstrations)."""
    extra_edits: int = 6
    """Change-and-restore copies of other lines per drill, besides the fix. 6 was chosen on the
    gate's validation instances: the SFT policy's pass@1 there rose from 0.062 (2) to 0.203 (6),
    32 tasks x 2 episodes each, the same tasks and seeds."""
    random_names: float = 0.0
    """Share of drill instances re-made with made-up identifiers (`drills.random_name_tasks`),
    where guessing a pool's name cannot be right (measured at 0.5: worse, see the README)."""
    made_up_modules: float = 0.5
    """Share of drill instances whose file gets a made-up name (`drills.module_renamed_tasks`),
    so the drills' `read_file` path is a copy of a name never seen before. At 0 the policy
    writes a memorised pool name instead; chosen with `DemoStage.made_up_modules` (README,
    "Tasks written by hand")."""
    word_modules: float = 0.5
    """As `DemoStage.word_modules`, for the drills."""
    copy_steps: int = 1000
    """Optimizer steps on synthetic copy sequences (`drills.copy_sequences`) before the drills:
    the content-keyed copy (induction head) the drills need and, alone, never form. 0 skips
    them. With them, 250 drill steps copy 0.87 of an edit's tokens under teacher forcing
    against 0.54 without (README, "the copy stage")."""
    copy_length: int = 96
    """Tokens per copy sequence. Short, because the copy forms from the gradient that reaches
    the one right position among all earlier ones: in 800 steps of 8 x 512 tokens it did not."""
    copy_batch_size: int = 32
    """Copy sequences per step."""
    copy_learning_rate: float = 1e-3
    """AdamW peak learning rate of the copy steps (cosine decay to 10%, 4% warm-up)."""
    whole_transcript: bool = False
    """Next-token loss on every token of a drill after the system prompt, the tool results
    included (`drills.whole_transcript_loss`), instead of on the policy's calls only."""
    mask_changes: bool = False
    """Leave the line a change edit picks at random (its `start` / `end`) out of the drills'
    loss (`drills.mask_change_addresses`): only the fix edits then teach where an edit goes."""
    steps: int = 1000
    """Optimizer steps (1000 x 8 = 2 passes over the drills: line-addressed copies are learnt
    faster than `str_replace`'s, which took 2000)."""
    batch_size: int = 8
    """Episodes per step."""
    learning_rate: float = 3e-3
    """AdamW peak learning rate (cosine decay to 10%, 4% warm-up)."""
    group_by_length: int = 0
    """0: batches drawn plainly at random. k > 1: each batch a slice of a mega-batch of k
    batches sorted by length (`offline.DataIterator`), so a batch pays for less padding: the
    SFT step is faster (`benchmarks/bench_sft_batching.py`). Off: with k = 16 for the drills
    and both SFT runs, the SFT policy's pass@1 on the 64 natural validation instances x 2 fell
    from 0.625 to 0.469 (paired -0.156 [-0.250, -0.062]) and on the 32 made-up-name ones x 4
    from 0.516 to 0.477; one run (README, "The whole study at the current defaults")."""


@dataclass(frozen=True)
class SFTStage:
    """Supervised fine-tuning of a fresh tiny policy (both SFT baselines use this)."""

    steps: int = 1500
    """Optimizer steps (1500 x 8 = 6 passes over the 2000 demonstrations; chosen with
    `demos.num_tasks` on the gate's validation instances, never on a held-out set)."""
    batch_size: int = 8
    """Episodes per step."""
    learning_rate: float = 2e-3
    """AdamW peak learning rate (cosine decay to 10%, 4% warm-up)."""
    group_by_length: int = 0
    """As `PretrainStage.group_by_length`, for both SFT runs."""


@dataclass(frozen=True)
class GateStage:
    """Before any RL: the SFT policy's own sampled episodes on validation instances (fresh
    instances of the training templates, never a held-out set), classified by failure layer
    (DESIGN §9b). RL only pays where the failures are decisions."""

    tasks: int = 32
    """Validation instances (train split, seed + 5555), `samples` episodes each."""
    samples: int = 2
    """Episodes per validation instance."""
    min_sequential_share: float = 0.5
    """RL starts only when at least this share of the failed episodes failed in the
    sequential-decisions layer; otherwise the report names the layer that still fails."""


@dataclass(frozen=True)
class RLStage:
    """GRPO from the SFT policy on the train split, once per seed; the control is the same
    run with rewards shuffled within each batch (same seeds); `second_algo` is one more
    estimator from the same start (seed `seeds[0]`), so the gain is not one loss's artefact."""

    algo: str = "grpo"
    """Registered loss (jaxrl_agent.losses.LOSSES)."""
    second_algo: str = "rloo"
    """The other estimator run once ("" skips it)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """RL and control seeds (task order and sampling); the first is the study's `seed` run.
    Empty (`--rl.seeds=`): no RL run, whatever the gate says; the study reports the SFT
    policies and its targets say RL was not run."""
    iterations: int = 30
    """Rollout-then-update iterations (x 48 episodes). 30 with canonical-like share 0.5 was
    chosen over 20 with 0.33 on validation instances (canonical-like 0.828 -> 0.930,
    natural 0.734 -> 0.781; README of the study, "The canonical task's kind")."""
    tasks_per_iter: int = 6
    """Training tasks per iteration."""
    group_size: int = 8
    """Episodes per task (the GRPO group)."""
    learning_rate: float = 2e-4
    """AdamW learning rate (constant)."""
    kl_coef: float = 0.1
    """Weight of the k3 KL-to-SFT penalty in the loss (0: none, as in DAPO / Dr. GRPO). 0.1 was
    chosen with `ablate.py` on fresh training-template instances: without it every setting we
    tried drifted below its start there (results/ablations)."""
    agg: str = "token-mean"
    """Loss aggregation (jaxrl_agent.losses.AGG_MODES)."""
    tool_error_penalty: float = 0.0
    """Shaped reward on a turn whose tool call failed (e.g. `old` text not found); 0: none."""
    interface_error_penalty: float = 0.0
    """Shaped reward on a turn whose call never reached a tool (malformed call); 0: none."""
    unchanged_edit_penalty: float = 0.0
    """Shaped reward on an edit that changed nothing (a correct line rewritten with what it
    holds: the loop that ends most of GRPO's budget-ended failures); 0: none. -0.1 did no
    better on validation (README of the study, "Budget-ended failures"). The shuffled-reward
    control permutes the verifier's rewards only, so it keeps this signal."""
    mini_batches: int = 4
    """Optimizer updates per rollout batch (group advantages are computed once over the
    whole batch, then PPO-clipped updates on each mini-batch)."""
    num_train_tasks: int = 2000
    """Training task pool (iterated in a seeded order; disjoint seeds from the held-out splits)."""
    silent_bug_share: float = 0.5
    """Share of the training pool whose dev tests pass with a bug still in the code
    (`silent_bugs.py`; the canonical task's kind), where the verifier pays for not trusting
    passing tests. 0 keeps the pool as generated: about a quarter of it is of that kind. 0.5
    was chosen on validation instances over 0, seeds 0 and 1: ahead in all four paired
    comparisons (validation +0.117, +0.023; silent validation instances +0.023, +0.039),
    significant in none (README of the study, "The silent-bug share")."""
    canonical_like_share: float = 0.5
    """Share of the training pool that is the canonical task's kind
    (`silent_bugs.canonical_like_tasks`: `bsearch_find` with both bound bugs, other names and
    inputs, drawn with the training seed), added after the silent-bug reweighting. Chosen on
    32 canonical-like validation instances x 4 (seed 0, one seed per setting), 20 iterations:
    0 -> 0.078, 0.2 -> 0.562, 0.33 -> 0.828 pass@1, natural validation 0.727 / 0.758 / 0.734;
    then 0.5 with 30 iterations -> 0.930, natural 0.781 (README of the study, "The canonical
    task's kind")."""
    eval_every: int = 10
    """Validation evaluation during the run: the learning curve, and the checkpoints
    `keep_best` chooses from."""
    curve_tasks: int = 24
    """Validation instances (train split, seed + 5555) in each learning-curve evaluation
    (1 episode each)."""
    keep_best: bool = True
    """Each RL and control run's policy is the one of its validation evaluations after
    training began (every `eval_every` iterations and the last) with the best pass@1, ties to
    the later (`RLConfig.keep_best`): early stopping on validation instances, never on a
    held-out set, the same rule for the controls. Why: in the study at 9e08a51 seed 0's
    validation pass@1 went 0.875 at iteration 20 -> 0.667 at 30 while its training success fell
    (0.92 -> 0.63 over the last three iterations) and tool errors rose (0 -> 0.29); its
    iteration-30 policy was shipped. False: the last iteration's policy, as before."""
    require_signal: bool = True
    """Refuse to run RL when the SFT policy never solves a training task (no GRPO signal)."""


@dataclass(frozen=True)
class EvalStage:
    """Final evaluation of every policy; the held-out sets are fixed by their seeds."""

    canonical_samples: int = 200
    """Episodes on the canonical binary-search task."""
    heldout_instance_tasks: int = 48
    """Held-out instances of the training templates."""
    heldout_template_tasks: int = 24
    """Instances of the four held-out templates."""
    samples_per_task: int = 2
    """Episodes per held-out task for the baselines and controls (pass@k uses k = this)."""
    passk_samples: int = 8
    """Episodes per held-out-instance task for SFT and the GRPO runs: pass@k for k = 1, 2, 4, 8
    (does RL lift pass@1 toward the SFT policy's pass@8?)."""
    seed: int = 1
    """Seed of the held-out task sets and of evaluation sampling."""


@dataclass(frozen=True)
class DiagnosticStage:
    """Teacher-forced next-action accuracy of every policy on expert episodes (diagnostics.py)."""

    tasks: int = 32
    """Fresh held-out instances (seed eval.seed + 200), one perfect expert episode each."""


@dataclass(frozen=True)
class StudyConfig:
    """The whole study."""

    pretrain: PretrainStage = field(default_factory=PretrainStage)
    demos: DemoStage = field(default_factory=DemoStage)
    sft: SFTStage = field(default_factory=SFTStage)
    gate: GateStage = field(default_factory=GateStage)
    rl: RLStage = field(default_factory=RLStage)
    eval: EvalStage = field(default_factory=EvalStage)
    diagnose: DiagnosticStage = field(default_factory=DiagnosticStage)
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    seed: int = 0
    """Seed of the training tasks, expert choices, initialisation and sampling."""
    tool_style: str = "short"
    """Chat tool style of every episode (tokenizer.ChatFormat): "short" (replace_lines edits),
    "numbered" (the same, its text written with read_file's `N|` prefixes) or "lines"
    (str_replace of whole lines: addressed by the line's content, no line number to look up)."""
    test_timeout_s: float = 0.05
    """Per-test CPU-time limit (seconds, ITIMER_PROF) of the agent's run_tests and of the
    verifier's hidden tests (`RolloutConfig.verify_test_timeout_s`). A correct solution in
    this family runs a test in well under a millisecond; a loop bug burns the whole limit per
    looping test, on the 2 cores the sampler needs too (`benchmarks/bench_rollout.py` for
    run_tests, `benchmarks/bench_verify_limit.py` for the verifier, whose default limit is 1 s:
    the canonical task's kind loops when submitted with its silent bug)."""
    report_unchanged_edits: bool = False
    """The tools answer "No change" to an edit that changes nothing (`ToolConfig.report_unchanged`)
    in the gate, RL and the evaluations; off: "Edited", as the shipped policies were measured."""
    policy_tokenizer: str = "file"
    """How the gate, the RL runs and the evaluations read an exported policy's tokenizer
    (`jaxrl_agent.tokenizer.load_tokenizer`): "file", the tokenizer.json the demonstrations,
    drills and SFT were tokenized with; "auto" reproduces the studies before that fix, served
    with transformers' Qwen2Tokenizer (README.md here, "the tokenizer skew")."""
    work_dir: str = "runs/binary_search_rl"
    """Large artefacts: demonstrations, checkpoints, policies. Finished stages are reused
    from here when their config is unchanged (delete the directory to start over)."""
    results_dir: str = "experiments/binary_search_rl/results"
    """Small, committed outputs: summary.json, plots, example trajectories."""
    sandbox_workers: int = 2
    """Sandbox worker processes (expert test runs, tools, verifier), per stage."""
    jobs: int = 2
    """Independent stages run this many at a time, each in a process of its own
    (`parallel.run_stages`): the demonstrations beside the drills; the success-only SFT, the RL
    runs and the evaluations in one pool, each evaluation queued as soon as its policy exists.
    An RL stage leaves part of two cores idle, so two at once finish sooner
    (`benchmarks/bench_study_jobs.py`); an SFT stage keeps both busy and gains nothing (the
    main README, "Where the time goes"). Every stage's result is the same either way, and 1
    runs them one after another in this process. Not in any stage's stamp."""
    sft_from: str = ""
    """An SFT policy directory (HF: config.json, model.safetensors, tokenizer) to start the gate,
    RL and the controls from instead of making one: the demonstrations, drills and both SFT
    stages are skipped, so the success-only baseline has no row. E.g. the shipped
    `experiments/binary_search_rl/results/policies/sft`, which is what these stages make at the
    defaults: the RL half of the study then fits a 2-core session (README, where the time goes)."""

    def __post_init__(self):  # checked before hours of SFT, not at the gate that reads it
        if self.jobs < 1:
            raise ValueError(f"jobs={self.jobs}: at least 1 (1 runs the stages one after another)")
        if self.policy_tokenizer not in TOKENIZER_MODES:
            raise ValueError(f"policy_tokenizer={self.policy_tokenizer!r}: one of {TOKENIZER_MODES}")


CPU_PRESET = StudyConfig()

GPU_PRESET = replace(
    StudyConfig(),
    pretrain=PretrainStage(num_tasks=20000, steps=3000, batch_size=32, learning_rate=2e-3),
    demos=DemoStage(num_tasks=4000),
    sft=SFTStage(steps=3000, batch_size=32, learning_rate=2e-3),
    rl=RLStage(iterations=100, tasks_per_iter=16, group_size=16, num_train_tasks=8000, eval_every=10,
               curve_tasks=64),
    gate=GateStage(tasks=128),
    eval=EvalStage(canonical_samples=400, heldout_instance_tasks=200, heldout_template_tasks=100, samples_per_task=4),
    diagnose=DiagnosticStage(tasks=100),
    model=TinyModelConfig(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=768),
    sandbox_workers=8,
    jobs=1,  # one accelerator: stages take turns on it
)
"""One accelerator and a 16-core host: a 2x wider, 6-layer model (5x the parameters), 5x the
drill instances and 12x the drill episodes, 7x the demonstrations, 20x the SFT samples, 100 RL iterations of 256 episodes."""

PRESETS = {"cpu": CPU_PRESET, "gpu": GPU_PRESET}
