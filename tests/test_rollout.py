"""agent/rollout.py: the agent loop's invariants with a real tiny policy (exact ids, masks, sampler
log-probs == trainer log-probs, repeatability) and with a scripted policy that really fixes
the task through the tools (rewards reach the episode), plus crash containment."""
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agent.agent import rollout as R
from jaxrl_agent.config import RolloutConfig, SamplingConfig
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import binary_search_task, generate_tasks
from jaxrl_agent.env.tools import format_tool_call
from jaxrl_agent.model.decoder import CausalLM, ModelConfig
from jaxrl_agent.model.outputs import policy_outputs
from jaxrl_agent.sampling.engine import SamplingEngine, TurnResult
from jaxrl_agent.tokenizer import ChatFormat, load_tokenizer

RC = RolloutConfig(group_size=2, max_total_tokens=512, max_tokens_per_turn=24, tool_threads=4)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def chat(tok):
    return ChatFormat(tok, tool_style="short")


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(num_workers=2, timeout_s=10) as sb:
        yield sb


@pytest.fixture(scope="module")
def model(tok):
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    return CausalLM(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engine(model, tok):
    return SamplingEngine(model, SamplingConfig(max_new_tokens=24, batch_size=3, cache_size=512,
                                                stop_token_ids=tuple(tok.stop_ids), prefill_buckets=(64, 256, 512)))


@pytest.fixture(scope="module")
def random_policy_run(engine, chat, sandbox):
    tasks = [binary_search_task(), *generate_tasks("train", 2, 0)]
    return tasks, *R.collect_episodes(tasks, engine, chat, sandbox, RC, seed=5)


def test_random_policy_episodes_are_exact_and_masked(random_policy_run, model, tok):
    tasks, eps, stats = random_policy_run
    assert len(eps) == len(tasks) * RC.group_size
    assert [e.group_id for e in eps] == [i for i in range(len(tasks)) for _ in range(RC.group_size)]
    assert sum(sum(e.loss_mask) for e in eps) == stats.tokens_sampled
    for e in eps:
        e.validate()
        assert e.reward == 0.0 and e.info["behaviour"]["failure_layer"] == "interface"
        m = np.array(e.loss_mask)
        assert m[: 10].sum() == 0  # the prompt is never trained on
        assert np.all(np.array(e.sampler_logp)[m == 0] == 0.0)
        assert np.all(np.array(e.sampler_logp)[m == 1] < 0.0)
    # the recorded sampler log-probs are the trainer's log-probs of the final sequences
    e = eps[0]
    ids = jnp.asarray([e.ids], jnp.int32)
    out = policy_outputs(model, ids, jnp.arange(len(e.ids), dtype=jnp.int32)[None], jnp.ones_like(ids))
    m = np.array(e.loss_mask) == 1
    np.testing.assert_allclose(np.asarray(out.logp)[0][m], np.array(e.sampler_logp)[m], atol=1e-4)


def test_same_seed_same_episodes(random_policy_run, engine, chat, sandbox):
    tasks, eps, _ = random_policy_run
    again, _ = R.collect_episodes(tasks[:1], engine, chat, sandbox, RC, seed=5)
    assert [e.ids for e in again] == [e.ids for e in eps[: RC.group_size]]


def test_rows_handed_back_mid_batch_sample_the_same_episodes(random_policy_run, engine, chat, sandbox):
    """RC's turns (up to 24 tokens) decode in 16-step chunks, each row going to its tools at
    the chunk boundary where its turn ended; whole-turn decoding (decode_chunk=0, every row
    waits for the slowest) samples the same episodes."""
    tasks, eps, stats = random_policy_run
    assert RC.decode_chunk and RC.decode_chunk < RC.max_tokens_per_turn
    assert max(len(t) for e in eps for t in _turns(e)) > RC.decode_chunk  # turns did span chunks
    whole, _ = R.collect_episodes(tasks, engine, chat, sandbox, replace(RC, decode_chunk=0), seed=5)
    assert [e.ids for e in whole] == [e.ids for e in eps]
    for a, b in zip(whole, eps):
        np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=1e-5)


def _turns(e):
    """The sampled spans (loss mask 1) of an episode, as lists of ids."""
    out, cur = [], []
    for i, m in zip(e.ids, e.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + ([cur] if cur else [])


class ScriptedEngine:
    """Stands in for SamplingEngine: row episodes 'sample' a fixed list of assistant texts."""

    def __init__(self, tok, script, batch_size=2):
        self.tok, self.script = tok, script
        self.config = SamplingConfig(max_new_tokens=256, batch_size=batch_size, cache_size=4096)
        self.live, self.turn = {}, {}

    def free_rows(self):
        return [r for r in range(self.config.batch_size) if r not in self.live]

    def start_episode(self, row, ids, seed=None):
        self.live[row], self.turn[row] = list(ids), 0

    def append(self, row, ids):
        self.live[row].extend(ids)

    def end_episode(self, row):
        self.live.pop(row)

    def sample_turn(self, rows, max_new_tokens=None):
        B, N = self.config.batch_size, self.config.max_new_tokens
        toks, logp = np.full((B, N), -1, np.int32), np.zeros((B, N), np.float32)
        num = np.zeros(B, np.int32)
        for r in rows:
            ids = self.tok.encode(self.script[self.turn[r]] + "<|im_end|>")
            self.turn[r] += 1
            toks[r, : len(ids)], logp[r, : len(ids)], num[r] = ids, -0.5, len(ids)
            self.live[r].extend(ids)
        reasons = tuple("stop" if r in rows else None for r in range(B))
        return TurnResult(toks, logp, logp, num, num > 0, reasons)

    def begin_turn(self, rows, max_new_tokens=None):
        self.speaking = [*getattr(self, "speaking", []), *rows]

    def advance(self, max_steps):  # every scripted turn ends in one call
        rows, self.speaking = self.speaking, []
        return self.sample_turn(rows)


def fix_script(task):
    bugs = task.metadata["bugs"]
    path = task.metadata["source_file"]
    edits = [format_tool_call("replace_lines", {"path": path, "start": b["line"], "end": b["line"],
                                                "text": b["fixed"].rstrip("\n")}) for b in bugs]  # one-line bugs
    test = format_tool_call("run_tests", {})
    return [format_tool_call("read_file", {"path": path}), test, edits[0], test, *edits[1:], test,
            format_tool_call("submit", {})]


def test_scripted_fix_earns_reward_through_the_loop(tok, chat, sandbox):
    task = binary_search_task()
    eng = ScriptedEngine(tok, fix_script(task))
    eps, stats = R.collect_episodes([task], eng, chat, sandbox, replace(RC, group_size=2, max_total_tokens=4096,
                                                                        max_tokens_per_turn=256))
    for e in eps:
        assert e.termination == "submitted" and e.reward == 1.0, e.info["verify"]
        b = e.info["behaviour"]
        assert b["edits"] == 2 and b["ran_tests_before_submit"] and b["saw_failing_tests"] and b["recovered"]
        assert e.turn_id[-1] == len(fix_script(task)) - 1
    assert stats.terminations == {"submitted": 2}
    # one bug fixed and submitted: a sequential-decision failure, scored 0 by the verifier
    half = fix_script(task)[:3] + [format_tool_call("submit", {})]
    eps, _ = R.collect_episodes([task], ScriptedEngine(tok, half), chat, sandbox,
                                replace(RC, group_size=1, max_total_tokens=4096, max_tokens_per_turn=256))
    assert eps[0].reward == 0.0 and eps[0].info["behaviour"]["failure_layer"] == "sequential"


def test_free_metadata_of_a_task_file_never_crashes_the_loop(tok, chat, sandbox):
    """A user's task whose free metadata holds `"bugs": 2` and a non-string template: the
    episodes run, the behaviour records unknown bugs, the summary is written."""
    from jaxrl_agent.agent.evaluation import summarize_episodes

    task = binary_search_task()
    script = fix_script(task)
    task.metadata = {"bugs": 2, "template": ["not", "a", "name"], "source_file": 7}
    eps, _ = R.collect_episodes([task], ScriptedEngine(tok, script), chat, sandbox,
                                replace(RC, group_size=1, max_total_tokens=4096, max_tokens_per_turn=256))
    assert eps[0].reward == 1.0 and eps[0].info["behaviour"]["bugs_total"] == 0
    summary = summarize_episodes(eps, k=1)
    assert summary["pass1"] == 1.0 and list(summary["per_template"]) == ["['not', 'a', 'name']"]


def test_the_verifier_runs_under_the_rollouts_per_test_limit(tok, chat, sandbox):
    """`RolloutConfig.verify_test_timeout_s` reaches the hidden-test run: the canonical task
    submitted unfixed loops (`low = mid` on the last element) and fails on that limit."""
    task = binary_search_task()
    for limit in (0.05, 0.3):
        eps, _ = R.collect_episodes([task], ScriptedEngine(tok, [format_tool_call("submit", {})]), chat, sandbox,
                                    replace(RC, group_size=1, max_total_tokens=4096, max_tokens_per_turn=256,
                                            verify_test_timeout_s=limit))
        failure = eps[0].info["verify"]["failures"][0]["message"]
        assert eps[0].reward == 0.0 and f"more than {limit:g} s of CPU time" in failure, failure
    with pytest.raises(ValueError, match="verify_test_timeout_s=0 must be > 0"):
        R.collect_episodes([task], ScriptedEngine(tok, []), chat, sandbox,
                           replace(RC, max_total_tokens=4096, max_tokens_per_turn=256, verify_test_timeout_s=0))


def test_verifier_crash_costs_the_episode_not_the_run(tok, chat, sandbox, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("verifier exploded")

    monkeypatch.setattr(R, "verify", boom)
    task = binary_search_task()
    eps, stats = R.collect_episodes([task], ScriptedEngine(tok, [format_tool_call("submit", {})]), chat, sandbox,
                                    replace(RC, group_size=2, max_total_tokens=4096, max_tokens_per_turn=256))
    assert all(e.termination == "sandbox_error" and e.reward == 0.0 for e in eps)
    kept, dropped = R.trainable(eps, RC)
    assert kept == [] and dropped["termination"] == 2


def test_trainable_drops_zero_variance_groups(random_policy_run):
    _, eps, _ = random_policy_run
    eps = [replace(e) for e in eps]
    eps[0].reward = 1.0  # group 0 now has a signal, the others do not
    kept, dropped = R.trainable(eps, replace(RC, filter_zero_variance=True))
    assert {e.group_id for e in kept} == {0} and dropped["zero_variance_groups"] == 2
    assert R.group_signal(eps)["mixed_group_share"] == pytest.approx(1 / 3)


def test_engine_too_small_is_a_clear_error(engine, chat, sandbox):
    with pytest.raises(ValueError, match="cache_size"):
        R.collect_episodes([binary_search_task()], engine, chat, sandbox, replace(RC, max_total_tokens=4096))


def test_sandbox_worker_death_costs_the_episode_not_the_run(tok, chat, sandbox):
    """A worker killed mid-rollout: the episode whose call (a test run or its verification) met
    it ends "sandbox_error" and is excluded from the update; the other one finishes normally."""
    import os
    import signal

    class KillOnce:  # the first sandbox call kills one worker: exactly one call will meet it
        def __init__(self, sb):
            self.sb, self.killed = sb, False

        def run(self, *a, **k):
            if not self.killed:
                self.killed = True
                os.kill(self.sb.worker_pids()[0], signal.SIGKILL)
            return self.sb.run(*a, **k)

        def __getattr__(self, name):  # judge, config, ... (verify's calls)
            return getattr(self.sb, name)

    task = binary_search_task()
    script = [format_tool_call("run_tests", {}), format_tool_call("submit", {})]
    eps, stats = R.collect_episodes([task], ScriptedEngine(tok, script, batch_size=1), chat, KillOnce(sandbox),
                                    replace(RC, group_size=2, max_total_tokens=4096, max_tokens_per_turn=256))
    assert sorted(e.termination for e in eps) == ["sandbox_error", "submitted"]
    kept, dropped = R.trainable(eps, RC)
    assert [e.termination for e in kept] == ["submitted"] and dropped["termination"] == 1
    # the pool replaced its workers: the next call works
    assert R.collect_episodes([task], ScriptedEngine(tok, script[1:]), chat, sandbox,
                              replace(RC, group_size=1, max_total_tokens=4096, max_tokens_per_turn=256))[0][0].termination == "submitted"
