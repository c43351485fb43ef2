"""HOST: `python -m jaxrl_agent <command> [--section.field=value ...]`.

Commands:
  demo     The main job: a tiny SFT policy's held-out success before and after a short RL
           run on the bug-fixing tasks, with an example trajectory (cli/demo.py).
  sft      Expert demonstrations -> SFT of a tiny policy -> HF directory.
  train    RL from an HF policy directory (loops/rl.py), with checkpoints and --resume=true.
  eval     pass@1 / pass@k (Wilson 95% intervals) and behaviour statistics -> JSON.
  export   The latest checkpoint of an RL run -> an HF directory.
  rm-train Preference pairs of episodes (a JSONL, or collected from a policy's rollouts:
           two episodes of one task whose verifier rewards differ) -> a Bradley-Terry
           reward model (the policy's decoder with a scalar head) -> HF directory, with
           its held-out pair accuracy (loops/reward_model.py). RL uses it with
           `train --rewards.source=sum --rewards.reward_model_path=DIR`.
  bandit   A multi-step tool-choice bandit trained with any registered loss (default GRPO):
           a tabular softmax policy picks a tool at each of `steps` decisions, observation
           tokens (loss_mask 0) sit between the decisions, and the reward is 1 only when
           every choice is right. It runs the real kernels (advantages, losses, optax) end
           to end and prints the success rate as it rises.

Overrides use dotted names, e.g. `--bandit.algo=rloo --loss.clip_high=0.28`; the resolved
config is printed at start; `python -m jaxrl_agent <command> --help` lists the command's options
with their defaults and meanings. `--compile_cache=DIR|off` places or disables JAX's persistent
compilation cache (cli/compile_cache.py; default: a user cache directory).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jaxrl_agent.cli.compile_cache import ENV_VAR
from jaxrl_agent.cli.compile_cache import enable as enable_compile_cache


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


# ---- commands: each module under cli/ holds its job's configs and its run function ----
def _demo():
    from jaxrl_agent.cli import demo

    return demo.DemoRunConfig, demo.run_demo_job


def _sft():
    from jaxrl_agent.cli import sft

    return sft.SFTRunConfig, sft.run_sft_job


def _train():
    from jaxrl_agent.cli import train

    return train.TrainRunConfig, train.run_train_job


def _eval():
    from jaxrl_agent.cli import eval as eval_cmd

    return eval_cmd.EvalRunConfig, eval_cmd.run_eval_job


def _export():
    from jaxrl_agent.cli import export

    return export.ExportRunConfig, export.run_export_job


def _rm_train():
    from jaxrl_agent.cli import rm_train

    return rm_train.RMTrainRunConfig, rm_train.run_rm_train_job


def _bandit():
    from jaxrl_agent.cli import bandit

    return bandit.BanditRunConfig, bandit.run_bandit_job


# name -> () -> (its run config class, its job); imported on use, so `--help` of one command
# imports only that command's module.
COMMANDS = {"demo": _demo, "sft": _sft, "train": _train, "eval": _eval, "export": _export, "rm-train": _rm_train,
            "bandit": _bandit}


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
        from jaxrl_agent.cli.config_docs import command_help

        print(command_help(named[0], command_summary(named[0]), COMMANDS[named[0]]()[0]()), end="")
        return 0
    parser = argparse.ArgumentParser(prog="python -m jaxrl_agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--compile_cache", default=None, metavar="DIR|off",
                        help=f"JAX's persistent compilation cache (default: ${{{ENV_VAR}}} or a user cache directory)")
    args, overrides = parser.parse_known_args(argv)
    cfg_cls, fn = COMMANDS[args.command]()
    try:
        cfg = apply_overrides(cfg_cls(), overrides)
    except ValueError as e:
        parser.error(str(e))
    print("config:", json.dumps(dataclasses.asdict(cfg), indent=None, sort_keys=True, default=str))
    from jaxrl_agent.agent.preference_pairs import PreferenceDataError
    from jaxrl_agent.loops.metrics import watch_compiles
    from jaxrl_agent.loops.rl import NoSignalError
    from jaxrl_agent.train.sharding import initialize_distributed

    enable_compile_cache(args.compile_cache)  # the second run of a job loads its compiles from disk
    watch_compiles()  # the RL loop logs time/compile: how much of the wait was JAX compiling
    initialize_distributed()  # multi-host only when the launcher's environment asks for it
    try:
        fn(cfg)
    except (FileNotFoundError, NoSignalError, PreferenceDataError) as e:  # a user's input problem: no traceback
        parser.exit(2, f"error: {e}\n")
    return 0
