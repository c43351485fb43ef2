"""Tests for train/checkpoint.py (with the SFT loop as the training run): a run killed after step k
and resumed from its checkpoint ends with the same parameters as an uninterrupted run;
keep-last-N; metadata (data position, config); incomplete saves are ignored; HF export."""
import os

import jax
import numpy as np
import pytest

import trainer_worker as tw
from jaxrl_agent import hf
from jaxrl_agent.config import CheckpointConfig, LoraConfig, MeshConfig, OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.loops.offline import run_sft
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.train.checkpoint import Checkpointer, export_hf
from jaxrl_agent.train.step import make_optimizer, make_train_step

MESH = MeshConfig(data=2, fsdp=4, preset="fsdp")  # sharded state: restore must re-shard it
OPTIM = OptimConfig(learning_rate=1e-2, schedule="cosine", warmup_steps=2, total_steps=6)
TRAJ = TrajectoryConfig(buckets=(32,), batch_multiple=8)
STEPS, KILL_AT = 5, 3


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def setup():
    model = tw.tiny_model()
    cfg = TrainConfig(compiler_options=tw.FAST, mesh=MESH)
    ts = make_train_step(LOSSES["sft"], make_optimizer(OPTIM), cfg, model)
    episodes = tw.random_episodes(24, seed=4)
    return model, cfg, ts, episodes


def _run(setup, directory, num_steps, on_step=None, save_every=2, keep=2):
    model, cfg, ts, episodes = setup
    return run_sft(model, episodes, train_cfg=cfg, optim_cfg=OPTIM, traj_cfg=TRAJ, num_steps=num_steps, batch_size=8,
                   ckpt_cfg=CheckpointConfig(directory=str(directory), max_to_keep=keep, save_every=save_every),
                   train_step=ts, on_step=on_step, seed=7)


def test_kill_and_resume_reproduces_the_uninterrupted_run(setup, tmp_path):
    full_state, full_hist, ts = _run(setup, tmp_path / "full", STEPS)

    def kill(step, metrics):
        if step == KILL_AT:
            raise Killed

    with pytest.raises(Killed):
        _run(setup, tmp_path / "killed", STEPS, on_step=kill)
    # step 3 finished but was not saved (save_every=2): the resume starts from step 2, so the
    # data iterator position must come back too for the batches to line up.
    assert Checkpointer(CheckpointConfig(directory=str(tmp_path / "killed"))).latest_step() == 2
    resumed_state, resumed_hist, _ = _run(setup, tmp_path / "killed", STEPS)
    assert len(resumed_hist) == STEPS - 2 and int(resumed_state.step) == STEPS
    np.testing.assert_allclose([h["loss"] for h in resumed_hist], [h["loss"] for h in full_hist[2:]], rtol=0, atol=0)
    for k, v in jax.device_get(full_state.params).items():
        np.testing.assert_array_equal(np.asarray(jax.device_get(resumed_state.params[k])), v, err_msg=k)
    full_opt, res_opt = jax.device_get(full_state.opt_state), jax.device_get(resumed_state.opt_state)
    for a, b in zip(jax.tree.leaves(full_opt), jax.tree.leaves(res_opt)):
        np.testing.assert_array_equal(a, b)
    assert resumed_state.params["wq"].sharding.spec == full_state.params["wq"].sharding.spec  # re-sharded
    assert full_hist[-1]["loss"] < full_hist[0]["loss"]


def test_keep_last_n_metadata_and_errors(setup, tmp_path):
    _, cfg, ts, _ = setup
    state, _, _ = _run(setup, tmp_path / "a", 5, save_every=1, keep=2)
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path / "a"), max_to_keep=2))
    assert ckpt.all_steps() == [4, 5] and ckpt.latest_step() == 5
    restored, meta = ckpt.restore(ts.abstract_state())
    assert meta["data_position"] == {"epoch": 1, "index": 16, "seed": 7, "num_items": 24}
    assert meta["config"]["mesh"]["preset"] == "fsdp" and meta["config"]["loss"]["agg"] == cfg.loss.agg
    assert meta["extra"]["loss"] == "sft" and meta["extra"]["optim"]["schedule"] == "cosine"
    assert int(restored.step) == 5 and np.array_equal(np.asarray(restored.rng), np.asarray(state.rng))
    with pytest.raises(FileNotFoundError, match="step 2"):
        ckpt.restore(ts.abstract_state(), step=2)
    ckpt.close()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(CheckpointConfig(directory=str(tmp_path / "empty"))).restore(ts.abstract_state())
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpointer(CheckpointConfig(directory=str(tmp_path / "b"), max_to_keep=0))


def test_incomplete_save_is_ignored(setup, tmp_path):
    """A save killed half-way leaves only orbax's temporary directory, which never counts."""
    _run(setup, tmp_path / "c", 2, save_every=1, keep=3)
    partial = tmp_path / "c" / "9.orbax-checkpoint-tmp-1234"
    os.makedirs(partial / "state")
    (partial / "state" / "junk").write_text("half-written")
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path / "c"), max_to_keep=3))
    assert ckpt.latest_step() == 2 and 9 not in ckpt.all_steps()
    ckpt.close()


def test_export_hf_round_trip(setup, tmp_path):
    model, _, _, _ = setup
    cfg = TrainConfig(compiler_options=tw.FAST, mesh=MeshConfig(data=1, fsdp=8, preset="fsdp"), lora=LoraConfig(rank=2))
    ts = make_train_step(LOSSES["sft"], make_optimizer(OPTIM), cfg, model)
    state = ts.init_state(model)
    # move the adapters' B off zero so the merged export differs from the base weights
    state = state.replace(params=jax.tree.map(lambda x: x + 0.05, state.params))
    export_hf(ts, state, model.config, str(tmp_path / "hf"))
    loaded, loaded_cfg = hf.load_pretrained(str(tmp_path / "hf"))
    assert loaded_cfg.hidden_size == model.config.hidden_size and loaded_cfg.qkv_bias
    want = jax.device_get(jax.jit(ts.policy_params, out_shardings=ts.replicated)(state))
    assert np.abs(want["wq"] - np.asarray(model.wq[...])).max() > 1e-3  # LoRA really merged
    for k, v in want.items():
        np.testing.assert_allclose(np.asarray(getattr(loaded, k)[...]), v, atol=1e-6, err_msg=k)


def test_policy_directory_carries_its_tokenizer(tmp_path):
    """An exported policy holds its tokenizer: `load_policy` and `AutoTokenizer` read it back.
    A directory without tokenizer files falls back to the repo tokenizer, and a tokenizer with
    more ids than the model's embedding rows is refused with both numbers."""
    from transformers import AutoTokenizer

    from jaxrl_agent.agent.policy import load_policy
    from jaxrl_agent.tokenizer import load_tokenizer

    tok = load_tokenizer()
    tok.hf.add_tokens(["<|scratchpad|>"])  # this policy's own tokenizer: one id more than the repo's
    model = tw.tiny_model(vocab_size=tok.vocab_size + 2)
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "read_file"}\n</tool_call><|scratchpad|><|im_end|>'
    policy = str(tmp_path / "policy")
    hf.save_pretrained(model, model.config, policy, tokenizer=tok)
    _, loaded = load_policy(policy)
    assert loaded.vocab_size == load_tokenizer().vocab_size + 1  # the directory's, not the repo's
    assert loaded.encode(text) == tok.encode(text) and len(tok.encode("<|scratchpad|>")) == 1
    assert (loaded.stop_ids, loaded.pad_id) == (tok.stop_ids, tok.pad_id)
    assert AutoTokenizer.from_pretrained(policy).encode(text, add_special_tokens=False) == tok.encode(text)

    bare = str(tmp_path / "bare")
    hf.save_pretrained(model, model.config, bare)
    assert load_policy(bare)[1].vocab_size == load_tokenizer().vocab_size
    small = tw.tiny_model()  # vocab 128
    with pytest.raises(ValueError, match=f"has {tok.vocab_size} ids .* vocab_size=128"):
        hf.save_pretrained(small, small.config, str(tmp_path / "refused"), tokenizer=tok)
    assert not os.path.exists(tmp_path / "refused")  # refused before anything was written
    hf.save_pretrained(small, small.config, str(tmp_path / "small"))
    with pytest.raises(ValueError, match=r"repo tokenizer has \d+ ids but the model .* vocab_size=128"):
        load_policy(str(tmp_path / "small"))
