"""Every shell command in the README is exercised by a test or by `.ci/run`.

The commands are the lines of the README's ```bash blocks, split at `&&`. Each must have an
entry in `HOW` below saying how it is exercised, and that way is checked here:

  ci       `.ci/run` runs it (or, for `-r requirements.txt`, a superset of it: .ci/run installs
           requirements-dev.txt, which includes requirements.txt). Checked against .ci/run.
  tiny     the same CLI path is run here, in a subprocess like the README's, with the README's
           arguments plus `TINY[...]` overrides appended (a later --x=v wins), so the real job
           runs end to end in seconds instead of minutes. Honest limit: the tiny `demo` policy
           has no signal on one task, so it takes the "no RL run" branch of the demo (the RL
           branch is what `train` runs below and tests/test_rl.py runs).
  static   cannot run here (no accelerator): checked that what it names exists.
  study    the study of experiments/binary_search_rl (an hour and more): its options resolve
           here; tests/test_study.py runs the same entry point with tiny overrides.

Arguments of every `python -m jaxrl_agent` command are also resolved through cli/main.py's own
override parser against the command's config, so a renamed option fails here even for a
command whose long run is replaced by a tiny one. A README command that is not in `HOW` fails
`test_every_readme_command_is_known`: add it with the way it is exercised.

The README's ```python blocks are compiled and their imports executed (the names they use
exist); the task-file block is run as is, in a temporary directory.
"""
import os
import re
import shlex
import subprocess
import sys

import pytest

from jaxrl_agent.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

SESSION = [  # the README's "typical session", in order (each step consumes the previous output)
    "python -m jaxrl_agent sft --sft.num_tasks=96 --sft.steps=600 --sft.run_dir=runs/sft",
    "python -m jaxrl_agent train --policy.path=runs/sft/policy --rl.algo=grpo --rl.iterations=50 --rl.run_dir=runs/rl",
    "python -m jaxrl_agent eval --policy.path=runs/rl/policy --eval.split=heldout_templates --eval.samples=8",
    "python -m jaxrl_agent export --policy.path=runs/sft/policy --export.run_dir=runs/rl --export.out=runs/exported",
]
MULTI_HOST = ("JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python -m jaxrl_agent train "
              "--policy.path=runs/sft/policy --train.mesh.fsdp=8 --train.mesh.preset=fsdp --rl.run_dir=runs/pod")

HOW = {
    "pip install -r requirements.txt -e .": "ci",
    "pip install -r requirements-dev.txt -e .": "ci",
    "python -m pytest tests": "ci",
    "python -m pytest tests/test_notebooks.py": "ci",
    "python -m jaxrl_agent demo": "tiny",
    **{c: "tiny" for c in SESSION},
    "python -m jaxrl_agent bandit --bandit.algo=rloo": "tiny",
    "python -m jaxrl_agent.cli.config_reference": "tiny",
    "python -m experiments.binary_search_rl": "study",
    "python -m experiments.binary_search_rl --preset=gpu": "study",
    "pip install -e .[cuda12]": "static",
    MULTI_HOST: "static",
}

# A small model and a short run: the README's arguments stay, these are appended.
TINY_MODEL = ["--model.num_layers=1", "--model.hidden_size=32", "--model.num_heads=2", "--model.num_kv_heads=1",
              "--model.intermediate_size=64"]
TINY_RL = ["--rl.iterations=1", "--rl.tasks_per_iter=1", "--rollout.group_size=2", "--rl.num_train_tasks=1",
           "--rl.eval_tasks=1", "--rl.eval_samples=1", "--rl.require_signal=false", "--rl.checkpoint_every=1",
           "--rollout.max_total_tokens=512", "--traj.buckets=512", "--sampling.batch_size=2"]
TINY = {
    "sft": ["--sft.num_tasks=1", "--sft.styles=perfect", "--sft.steps=2", "--sft.batch_size=1"] + TINY_MODEL,
    "train": TINY_RL,
    "eval": ["--eval.num_tasks=1", "--eval.samples=1", "--rollout.max_total_tokens=512", "--sampling.batch_size=1"],
    "export": [],
    "demo": ["--demo.iterations=1", "--demo.tasks_per_iter=1", "--demo.group_size=2", "--demo.eval_tasks=1",
             "--demo.eval_samples=1", "--demo.mini_batches=1"],
    "bandit": ["--bandit.iterations=5"],
}


# ---- reading the README ----
def readme_blocks(lang: str) -> list[str]:
    text = open(README).read()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def readme_commands() -> list[str]:
    """Simple commands of the ```bash blocks: continuation lines joined, split at `&&`."""
    out = []
    for block in readme_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out += [" ".join(part.split()) for part in line.split("&&")]
    return list(dict.fromkeys(out))


def _jaxrl_argv(command: str) -> list[str]:
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # leading VAR=value assignments
        words = words[1:]
    assert words[:3] == ["python", "-m", "jaxrl_agent"], command
    return words[3:]


# ---- the inventory ----
def test_every_readme_command_is_known():
    commands = readme_commands()
    assert len(commands) >= 10, commands  # the README's set-up, session, export, GPU and multi-host blocks
    unknown = [c for c in commands if c not in HOW]
    assert not unknown, f"README commands nobody exercises (add them to HOW in {__file__}): {unknown}"
    stale = [c for c in HOW if c not in commands]
    assert not stale, f"HOW lists commands the README no longer has: {stale}"


def test_the_two_setup_commands_are_unchanged():
    blocks = readme_blocks("bash")
    assert blocks[0] == "pip install -r requirements.txt -e . && python -m jaxrl_agent demo\n"
    assert blocks[1] == "pip install -r requirements-dev.txt -e . && python -m pytest tests\n"


def test_every_cli_command_resolves_its_options():
    """cli/main.py's own override parser accepts every option the README passes (no job is run)."""
    for command in readme_commands():
        if " jaxrl_agent " not in f" {command} ":
            continue
        name, *overrides = _jaxrl_argv(command)
        run_config, _ = cli.COMMANDS[name]()
        cli.apply_overrides(run_config(), overrides)  # raises naming the bad key or value


# ---- ci ----
def test_ci_commands_are_in_ci_run():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    lines = {" ".join(w for w in shlex.split(line) if w != "-q").replace("python -m pip", "pip")
             for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")}
    for command, how in HOW.items():
        if how != "ci":
            continue
        if command == "pip install -r requirements.txt -e .":  # .ci/run installs a superset of it
            assert "-r requirements.txt" in open(os.path.join(ROOT, "requirements-dev.txt")).read().splitlines()
            command = "pip install -r requirements-dev.txt -e ."
        if command.startswith("python -m pytest tests/"):  # one file of what .ci/run runs
            assert os.path.isfile(os.path.join(ROOT, command.split()[-1])), command
            command = "python -m pytest tests"
        assert command in lines, f"{command!r} is not run by .ci/run"


# ---- static ----
def test_static_commands_name_what_exists():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert "jax[cuda12]" in extras["cuda12"][0] and {"cuda13", "tpu"} <= set(extras)

    # multi-host: the variables are the ones sharding.initialize_distributed reads; what it does
    # with them is tests/test_distributed.py and tests/test_rl_distributed.py (two real
    # processes, launched by tests/process_launcher.py) and tests/test_sharding.py.
    import inspect

    from jaxrl_agent.train import sharding

    src = inspect.getsource(sharding.initialize_distributed)
    for var in re.findall(r"\b([A-Z_]+)=", MULTI_HOST):
        assert f'"{var}"' in src, var
    test_src = open(os.path.join(ROOT, "tests", "test_distributed.py")).read()
    assert "def test_two_processes_match_one_process" in test_src and "from process_launcher import launch" in test_src
    rl_src = open(os.path.join(ROOT, "tests", "test_rl_distributed.py")).read()
    assert "def test_two_processes_split_the_rollouts_and_match_one_process" in rl_src
    assert "JAX_COORDINATOR_ADDRESS" in open(os.path.join(ROOT, "tests", "process_launcher.py")).read()


# ---- the study (issue 8) ----
def test_study_commands_resolve_their_options():
    """The study's README commands resolve through its own parser (preset, then overrides);
    tests/test_study.py runs the same entry point end to end with tiny overrides."""
    from experiments.binary_search_rl.config import PRESETS

    for command, how in HOW.items():
        if how != "study":
            continue
        words = shlex.split(command)
        assert words[:3] == ["python", "-m", "experiments.binary_search_rl"], command
        presets = [w.split("=", 1)[1] for w in words[3:] if w.startswith("--preset=")]
        cli.apply_overrides(PRESETS[(presets or ["cpu"])[-1]], [w for w in words[3:] if not w.startswith("--preset=")])
    src = open(os.path.join(ROOT, "tests", "test_study.py")).read()
    assert "def test_study_runs_every_stage_and_writes_the_summary" in src and "main(args)" in src


# ---- tiny runs ----
def _run(argv: list[str], cwd: str, timeout: int = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, like a user's shell
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    res = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{argv}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def test_config_reference_command():
    """The README's regenerate command, with --check so the committed file is compared, not rewritten."""
    _run(["-m", "jaxrl_agent.cli.config_reference", "--check"], cwd=ROOT)


def test_bandit_command(tmp_path):
    out = _run(["-m", "jaxrl_agent", *_jaxrl_argv("python -m jaxrl_agent bandit --bandit.algo=rloo"),
                *TINY["bandit"]], cwd=str(tmp_path))
    assert '"algo": "rloo"' in out


@pytest.mark.slow
def test_demo_command(tmp_path):
    out = _run(["-m", "jaxrl_agent", "demo", *TINY["demo"]], cwd=str(tmp_path))
    # either outcome of the demo's signal check is a finished job; both print held-out pass@1
    assert "held-out" in out and "pass@1" in out, out[-2000:]
    assert ("no RL run" in out) or ("example trajectory" in out), out[-2000:]


@pytest.mark.slow
def test_session_commands_sft_train_eval_export(tmp_path):
    """The README's session in order, from a temporary directory (its relative runs/ paths
    land there): each step reads what the previous one wrote."""
    for command in SESSION:
        name, *overrides = _jaxrl_argv(command)
        _run(["-m", "jaxrl_agent", name, *overrides, *TINY[name]], cwd=str(tmp_path))
    runs = tmp_path / "runs"
    for path in ("sft/policy/config.json", "rl/policy/model.safetensors", "rl/metrics.jsonl",
                 "exported/model.safetensors"):
        assert (runs / path).is_file(), path
    assert (tmp_path / "runs" / "eval.json").is_file()  # eval's default --eval.out


# ---- python blocks ----
def test_python_blocks_compile_and_import():
    blocks = readme_blocks("python")
    assert len(blocks) >= 3
    for block in blocks:
        code = compile(block, "README.md", "exec")
        imports = "\n".join(line for line in block.splitlines() if line.startswith(("import ", "from ")))
        exec(compile(imports, "README.md", "exec"), {})
        assert code is not None


def test_task_file_block_runs(tmp_path, monkeypatch):
    (block,) = [b for b in readme_blocks("python") if "save_tasks(" in b]
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    assert (tmp_path / "my_tasks.jsonl").is_file()
