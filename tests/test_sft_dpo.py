"""Tests for loops/offline.py: SFT on chat-format episodes with the assistant-only loss mask, and DPO
on preference pairs, both through the same TrainStep as RL."""
import numpy as np
import pytest

import trainer_worker as tw
from jaxrl_agent.config import MeshConfig, OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.env.tool_calls import format_tool_call
from jaxrl_agent.loops.offline import DataIterator, run_dpo, run_sft
from jaxrl_agent.tokenizer import ChatFormat, EpisodeBuilder, load_tokenizer
from jaxrl_agent.train.step import TrainStep
from jaxrl_agent.trajectory import Episode, collate

TRAJ = TrajectoryConfig(buckets=(64, 128, 256), batch_multiple=4)
CFG = TrainConfig(compiler_options=tw.FAST, mesh=MeshConfig(data=4, fsdp=2, preset="fsdp"))


def _episode(chat, i, first_tool):
    """An expert-style transcript: read the file, see it, submit (or a worse first action)."""
    ep = EpisodeBuilder(chat, [{"role": "system", "content": "You fix bugs."},
                               {"role": "user", "content": f"Fix f{i}.py"}])
    tok = chat.tokenizer
    args = {"path": f"f{i}.py"} if first_tool == "read_file" else {}
    first = tok.encode(format_tool_call(first_tool, args)) + [tok.im_end_id]
    ep.append_sampled(first, [-1.0] * len(first), context=len(ep))
    ep.append_observation(f"def f{i}(): return {i}")
    done = tok.encode(format_tool_call("submit", {})) + [tok.im_end_id]
    ep.append_sampled(done, [-1.0] * len(done), context=len(ep))
    return Episode.from_builder(ep, termination="submitted")


@pytest.fixture(scope="module")
def data():
    tok = load_tokenizer()
    chat = ChatFormat(tok, tool_style="short")
    good = [_episode(chat, i, "read_file") for i in range(8)]
    bad = [_episode(chat, i, "list_files") for i in range(8)]
    model = tw.tiny_model(vocab_size=tok.vocab_size)
    return tok, good, bad, model


def test_sft_trains_only_assistant_tokens(data):
    tok, good, _, model = data
    batch, _ = collate(good[:4], TRAJ)
    ep = good[0]
    sampled = [t for t, m in zip(ep.ids, ep.loss_mask) if m]
    assert sampled[-1] == tok.im_end_id and tok.decode(sampled).count("<tool_call>") == 2
    prompt = [t for t, m in zip(ep.ids, ep.loss_mask) if not m]
    assert "Fix f0.py" in tok.decode(prompt) and "def f0()" in tok.decode(prompt)  # user + tool text: mask 0
    state, hist, ts = run_sft(model, good, train_cfg=CFG, optim_cfg=OptimConfig(learning_rate=1e-2), traj_cfg=TRAJ,
                              num_steps=25, batch_size=4)
    assert isinstance(ts, TrainStep)
    assert hist[0]["policy_tokens"] == float(batch.loss_mask.sum())  # the loss counts assistant tokens only
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"], [h["loss"] for h in hist]
    assert all(np.isfinite(h["grad_norm"]) for h in hist)
    # group_by_length reaches the data iterator: the first step trains the first grouped batch
    mixed = good + data[2][:4]  # shorter first calls: lengths differ
    firsts = {g: DataIterator(mixed, 4, seed=0, lengths=[len(e) for e in mixed], group_by_length=g).next()
              for g in (0, 3)}
    tokens = {g: float(sum(sum(e.loss_mask) for e in b)) for g, b in firsts.items()}
    assert tokens[0] != tokens[3]  # the check below can tell the two apart
    _, hist, _ = run_sft(model, mixed, train_cfg=CFG, optim_cfg=OptimConfig(learning_rate=1e-2), traj_cfg=TRAJ,
                         num_steps=1, batch_size=4, group_by_length=3, train_step=ts)
    assert hist[0]["policy_tokens"] == tokens[3]


def test_dpo_prefers_chosen(data):
    _, good, bad, model = data
    pairs = list(zip(good, bad))
    state, hist, ts = run_dpo(model, pairs, train_cfg=CFG, optim_cfg=OptimConfig(learning_rate=1e-2),
                              traj_cfg=TRAJ, num_steps=12, batch_size=4)
    assert isinstance(ts, TrainStep) and ts.cfg.use_ref  # reference = the frozen initial policy
    assert abs(hist[0]["loss"] - np.log(2.0)) < 1e-4  # policy == reference at step 1
    assert hist[0]["reward_margin"] == 0.0
    assert hist[-1]["loss"] < 0.3 and hist[-1]["reward_accuracy"] == 1.0
    assert hist[-1]["reward_margin"] > 0


def test_offline_errors_and_iterator(data):
    _, good, _, model = data
    no_target = Episode(good[0].ids, [0] * len(good[0]), [0.0] * len(good[0]), good[0].turn_id)
    with pytest.raises(ValueError, match="no assistant"):
        run_sft(model, [no_target], train_cfg=CFG, optim_cfg=OptimConfig(), traj_cfg=TRAJ, num_steps=1, batch_size=1)
    with pytest.raises(ValueError, match="side without response"):
        run_dpo(model, [(good[0], no_target)], train_cfg=CFG, optim_cfg=OptimConfig(), traj_cfg=TRAJ, num_steps=1,
                batch_size=1)
    it = DataIterator(list(range(5)), 2, seed=3)
    first = [it.next() for _ in range(4)]  # epochs of 2 batches (remainder dropped)
    assert len(set(first[0] + first[1])) == 4 and len(set(first[2] + first[3])) == 4  # no repeats in an epoch
    pos = it.position()
    again = DataIterator(list(range(5)), 2, seed=3)
    again.restore(pos)
    assert again.next() == it.next()
    with pytest.raises(ValueError, match="does not match"):
        DataIterator(list(range(6)), 2, seed=3).restore(pos)
    with pytest.raises(ValueError, match="batch_size"):
        DataIterator([1, 2], 3)


def test_data_iterator_groups_by_length_without_losing_or_repeating_items():
    """`group_by_length`: every item once per epoch, each batch a slice of a sorted mega-batch
    (less padding than plain shuffling), resumable; off it is the plain permutation."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(400, 900, size=100)
    plain = DataIterator(list(range(100)), 4, seed=5)
    assert plain.next() == list(np.random.default_rng([5, 0]).permutation(100)[:4])  # unchanged when off
    it = DataIterator(list(range(100)), 4, seed=5, lengths=lengths, group_by_length=5)
    epoch = [it.next() for _ in range(25)]
    assert sorted(i for b in epoch for i in b) == list(range(100))
    assert all(list(lengths[b]) == sorted(lengths[b], reverse=True) for b in epoch)

    def waste(batches):  # padded slots when each batch is padded to its longest row
        return sum(4 * lengths[b].max() - lengths[b].sum() for b in batches)

    plain = DataIterator(list(range(100)), 4, seed=5)
    assert waste(epoch) < 0.5 * waste([plain.next() for _ in range(25)])
    assert [it.next() for _ in range(25)] != epoch  # a new epoch, new batches
    pos = it.position()
    again = DataIterator(list(range(100)), 4, seed=5, lengths=lengths, group_by_length=5)
    again.restore(pos)
    assert again.next() == it.next()
    with pytest.raises(ValueError, match="does not match"):
        DataIterator(list(range(100)), 4, seed=5).restore(pos)
    with pytest.raises(ValueError, match="one length per item"):
        DataIterator(list(range(100)), 4, group_by_length=5)
