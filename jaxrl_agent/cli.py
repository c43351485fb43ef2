"""HOST: `python -m jaxrl_agent <command> [--section.field=value ...]`.

Commands:
  demo     The main job: a tiny SFT policy's held-out success before and after a short RL
           run on the bug-fixing tasks, with an example trajectory (demo.py).
  sft      Expert demonstrations -> SFT of a tiny policy -> HF directory.
  train    RL from an HF policy directory (rl.py), with checkpoints and --resume=true.
  eval     pass@1 / pass@k (Wilson 95% intervals) and behaviour statistics -> JSON.
  export   The latest checkpoint of an RL run -> an HF directory.
  rm-train Preference pairs of episodes (a JSONL, or collected from a policy's rollouts:
           two episodes of one task whose verifier rewards differ) -> a Bradley-Terry
           reward model (the policy's decoder with a scalar head) -> HF directory, with
           its held-out pair accuracy (reward_model.py). RL uses it with
           `train --rewards.source=sum --rewards.reward_model_path=DIR`.
  bandit   A multi-step tool-choice bandit trained with any registered loss (default GRPO):
           a tabular softmax policy picks a tool at each of `steps` decisions, observation
           tokens (loss_mask 0) sit between the decisions, and the reward is 1 only when
           every choice is right. It runs the real kernels (advantages, losses, optax) end
           to end and prints the success rate as it rises.

Overrides use dotted names, e.g. `--bandit.algo=rloo --loss.clip_high=0.28`; the resolved
config is printed at start; `python -m jaxrl_agent <command> --help` lists the command's options
with their defaults and meanings. `--compile_cache=DIR|off` places or disables JAX's persistent
compilation cache (compile_cache.py; default: a user cache directory).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field

from jaxrl_agent.compile_cache import ENV_VAR
from jaxrl_agent.compile_cache import enable as enable_compile_cache
from jaxrl_agent.config import LossConfig


@dataclass(frozen=True)
class BanditConfig:
    """The tool-choice bandit (see module docstring)."""

    algo: str = "grpo"
    """Registered loss name (jaxrl_agent.losses.LOSSES)."""
    contexts: int = 8
    """Number of distinct task types (each has its own correct tool sequence)."""
    tools: int = 4
    """Number of tools to choose from at each decision."""
    steps: int = 2
    """Decisions per episode; reward 1 only if all are right."""
    group_size: int = 16
    """Episodes sampled per task (the GRPO group)."""
    tasks_per_iter: int = 4
    """Tasks (groups) per iteration."""
    iterations: int = 60
    """Policy updates."""
    lr: float = 0.1
    """Adam learning rate."""
    seed: int = 0
    """PRNG seed (tasks, sampling)."""


@dataclass(frozen=True)
class BanditRunConfig:
    bandit: BanditConfig = field(default_factory=BanditConfig)
    loss: LossConfig = field(default_factory=lambda: LossConfig(kl_coef=0.0))


# ---- dotted overrides ----
def _coerce(text: str, current):
    if isinstance(current, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"expected a boolean, got {text!r}")
    if text.lower() == "none":
        return None
    if isinstance(current, tuple):  # comma-separated, typed like the default's first item
        items = [t for t in text.split(",") if t != ""]
        return tuple(_coerce(t, current[0]) if current else t for t in items)
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float) or current is None:
        try:
            return float(text)
        except ValueError:
            return text
    return text


def apply_overrides(cfg, overrides: list[str]):
    """Return `cfg` with `--a.b=value` overrides applied (nested frozen dataclasses).

    Raises ValueError naming the bad key or value.
    """
    for item in overrides:
        if not item.startswith("--") or "=" not in item:
            raise ValueError(f"override {item!r} must look like --section.field=value")
        key, value = item[2:].split("=", 1)
        path = key.split(".")

        def set_path(obj, path):
            names = {f.name for f in dataclasses.fields(obj)}
            if path[0] not in names:
                raise ValueError(f"unknown config key {key!r} ({path[0]!r} not in {sorted(names)})")
            current = getattr(obj, path[0])
            if len(path) == 1:
                if dataclasses.is_dataclass(current):
                    raise ValueError(f"{key!r} is a section; set one of its fields")
                try:
                    new = _coerce(value, current)
                except ValueError as e:
                    raise ValueError(f"bad value for {key!r}: {e}") from None
                return dataclasses.replace(obj, **{path[0]: new})
            if not dataclasses.is_dataclass(current):
                raise ValueError(f"{key!r}: {path[0]!r} is not a section")
            return dataclasses.replace(obj, **{path[0]: set_path(current, path[1:])})

        cfg = set_path(cfg, path)
    return cfg


# ---- commands ----
def cmd_bandit(cfg: BanditRunConfig) -> dict:
    from jaxrl_agent.bandit import train_bandit

    return train_bandit(cfg.bandit, cfg.loss)


def _pipeline(name: str):
    def run(cfg):
        from jaxrl_agent import pipelines

        return getattr(pipelines, f"run_{name}_job")(cfg)

    return run


def _config(name: str):
    from jaxrl_agent import pipelines

    return getattr(pipelines, name)


def _demo(name: str):
    from jaxrl_agent import demo

    return getattr(demo, name)


def _rm(name: str):
    from jaxrl_agent import reward_model

    return getattr(reward_model, name)


COMMANDS = {
    "bandit": (lambda: BanditRunConfig, cmd_bandit),
    "demo": (lambda: _demo("DemoRunConfig"), lambda cfg: _demo("run_demo_job")(cfg)),
    "sft": (lambda: _config("SFTRunConfig"), _pipeline("sft")),
    "train": (lambda: _config("TrainRunConfig"), _pipeline("train")),
    "eval": (lambda: _config("EvalRunConfig"), _pipeline("eval")),
    "export": (lambda: _config("ExportRunConfig"), _pipeline("export")),
    "rm-train": (lambda: _rm("RMTrainRunConfig"), lambda cfg: _rm("run_rm_train_job")(cfg)),
}


def command_summary(name: str) -> str:
    """The command's paragraph of this module's docstring ("Commands:")."""
    lines = __doc__.split("Commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [name])
    block = [lines[start].strip()[len(name):].strip()]
    for line in lines[start + 1:]:
        if not line.startswith(" " * 11):
            break
        block.append(line.strip())
    return " ".join(block)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = [a for a in argv if a in COMMANDS]
    if named and any(a in ("-h", "--help") for a in argv):  # the command's own options, not the top-level usage
        from jaxrl_agent.config_docs import command_help

        print(command_help(named[0], command_summary(named[0]), COMMANDS[named[0]][0]()()), end="")
        return 0
    parser = argparse.ArgumentParser(prog="python -m jaxrl_agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--compile_cache", default=None, metavar="DIR|off",
                        help=f"JAX's persistent compilation cache (default: ${{{ENV_VAR}}} or a user cache directory)")
    args, overrides = parser.parse_known_args(argv)
    cfg_cls, fn = COMMANDS[args.command]
    try:
        cfg = apply_overrides(cfg_cls()(), overrides)
    except ValueError as e:
        parser.error(str(e))
    print("config:", json.dumps(dataclasses.asdict(cfg), indent=None, sort_keys=True, default=str))
    from jaxrl_agent.preference_pairs import PreferenceDataError
    from jaxrl_agent.rl import NoSignalError
    from jaxrl_agent.sharding import initialize_distributed

    enable_compile_cache(args.compile_cache)  # the second run of a job loads its compiles from disk
    initialize_distributed()  # multi-host only when the launcher's environment asks for it
    try:
        fn(cfg)
    except (FileNotFoundError, NoSignalError, PreferenceDataError) as e:  # a user's input problem: no traceback
        parser.exit(2, f"error: {e}\n")
    return 0
