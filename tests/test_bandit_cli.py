"""The bandit main job learns with every RL loss (update direction is right), and the CLI's
dotted overrides resolve or fail with a clear message."""
import pytest

from jaxrl_agent.cli.bandit import BanditRunConfig
from jaxrl_agent.cli.main import apply_overrides, main
from jaxrl_agent.loops.bandit import train_bandit
from jaxrl_agent.losses.registry import ALGORITHM_DEFAULTS, RL_LOSSES


@pytest.mark.parametrize("algo", RL_LOSSES)
def test_every_rl_loss_improves_the_bandit(algo):
    cfg = apply_overrides(BanditRunConfig(), [f"--bandit.algo={algo}", "--bandit.iterations=40"])
    loss_cfg = ALGORITHM_DEFAULTS[algo]
    if algo == "gspo":  # GSPO's tiny sequence clip range needs more steps per batch to move
        cfg = apply_overrides(cfg, ["--bandit.iterations=80"])
    res = train_bandit(cfg.bandit, loss_cfg, verbose=False)
    assert res["success_before"] < 0.2
    assert res["success_after"] > res["success_before"] + 0.4, res


def test_overrides_apply_and_reject():
    cfg = apply_overrides(BanditRunConfig(), ["--loss.clip_high=0.28", "--loss.dual_clip=none",
                                              "--bandit.tools=3", "--loss.norm_by_std=false"])
    assert cfg.loss.clip_high == 0.28 and cfg.loss.dual_clip is None
    assert cfg.bandit.tools == 3 and cfg.loss.norm_by_std is False
    with pytest.raises(ValueError, match="unknown config key 'loss.clip_hi'"):
        apply_overrides(cfg, ["--loss.clip_hi=0.3"])
    with pytest.raises(ValueError, match="bad value for 'bandit.tools'"):
        apply_overrides(cfg, ["--bandit.tools=many"])
    with pytest.raises(ValueError, match="must look like"):
        apply_overrides(cfg, ["loss.clip_high=0.3"])


def test_bad_algo_is_a_clear_error():
    cfg = apply_overrides(BanditRunConfig(), ["--bandit.algo=sft"])
    with pytest.raises(ValueError, match="bandit.algo must be an RL loss"):
        train_bandit(cfg.bandit, cfg.loss, verbose=False)


def test_cli_rejects_unknown_override(capsys):
    with pytest.raises(SystemExit):
        main(["bandit", "--bandit.nope=1"])
    assert "unknown config key" in capsys.readouterr().err
