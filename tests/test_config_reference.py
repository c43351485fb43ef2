"""docs/config_reference.md is generated from the config dataclasses' field docstrings
(jaxrl_agent/cli/config_reference.py); it must equal the generator's output, so it never goes
stale, and a field without a docstring must be an error rather than a silent gap."""
import dataclasses
import os

import pytest

from jaxrl_agent.cli import config_docs as docs_lib
from jaxrl_agent.cli import config_reference as ref
from jaxrl_agent.config import LossConfig, RLConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "docs", "config_reference.md")


@pytest.fixture(scope="module")
def generated() -> str:
    return ref.generate()


def test_committed_reference_is_current(generated):
    with open(COMMITTED) as f:
        committed = f.read()
    assert committed == generated, "docs/config_reference.md is stale: run `python -m jaxrl_agent.cli.config_reference`"


def test_every_field_and_command_is_in_the_reference(generated):
    from jaxrl_agent.cli import main as cli

    for cls in (LossConfig, RLConfig):
        _, docs = docs_lib.field_docs(cls)
        for f in dataclasses.fields(cls):
            # the table renders a multi-line docstring on one line
            assert f"| `{f.name}` |" in generated and " ".join(docs[f.name][1].split()) in generated, f.name
    for name in cli.COMMANDS:
        assert f"### `python -m jaxrl_agent {name}`" in generated
    assert docs_lib.PACKAGE_DIR not in generated  # no machine-specific paths


def test_command_defaults_are_cli_syntax(generated):
    # `train` and `eval` change the sampler's shape (sampling.engine_config.agent_sampling); the reference
    # shows it as the override that would set it.
    assert "`--sampling.prefill_buckets=64,128,256,512,1024`" in generated
    assert "`--optim.learning_rate=0.0001`" in generated


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    """A config with one documented and one undocumented field."""

    documented: int = 1
    """Has a docstring."""
    bare: float = 2.0


def test_a_field_without_docstring_is_an_error():
    with pytest.raises(ValueError, match=r"without a docstring: \['bare'\]"):
        ref.class_table(_Undocumented)
    assert docs_lib.field_docs(_Undocumented)[1]["documented"] == ("int", "Has a docstring.")


def test_check_mode_reports_stale_files(tmp_path):
    out = str(tmp_path / "ref.md")
    assert ref.main(["--check", "--out", out]) == 1  # missing
    assert ref.main(["--out", out]) == 0
    assert ref.main(["--check", "--out", out]) == 0
    with open(out, "a") as f:
        f.write("hand edit\n")
    assert ref.main(["--check", "--out", out]) == 1


@pytest.mark.parametrize("name", ["eval", "bandit", "rm-train"])
def test_command_help_lists_its_options_and_runs_nothing(name, capsys):
    """`python -m jaxrl_agent <command> --help` prints that command's summary and every option
    with the command's default and its docstring, then exits 0 without running the job."""
    from jaxrl_agent.cli import main as cli

    assert cli.main([name, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m jaxrl_agent {name} ") and "config:" not in text
    assert " ".join(cli.command_summary(name).split()[:6]) in " ".join(text.split())
    options = docs_lib.option_lines(cli.COMMANDS[name]()[0]())
    assert options and all(opt in text for opt, _ in options)
    for opt, doc in options:
        assert doc, f"{opt} has no meaning"
    if name == "eval":
        assert "--eval.samples=4" in text and "Episodes per task" in text
