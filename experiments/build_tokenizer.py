"""HOST: rebuild the repo's tiny byte-level BPE tokenizer (jaxrl_agent/assets/tokenizer/).

    python experiments/build_tokenizer.py [--vocab-size 2048] [--episodes 1000] [--seed 0] [--out DIR]

The corpus is what the tiny policies actually read and write, in the tools' actual formats:
real episodes of the scripted expert (`env/expert.py`, every imperfection style) on generated
training tasks, played through the real tools and sandbox and rendered by the real chat
format, half in each tool style ("short": `replace_lines` and the short system prompt; "full":
`str_replace` and the Qwen2.5 schemas), plus the task files as they lie on disk (buggy and
fixed sources, dev and hidden tests). Only the "train" split is used, with its own seed, so
the held-out sets play no part. ChatML and tool-call markers are added tokens, so each is one
id; the rest is byte-level BPE after a pre-tokenization that is Qwen2's (digits split one by
one, runs of spaces kept together for indentation) with three changes, so that a line of code
splits into the same tokens wherever it appears (`replace_lines` copies, env/tool_calls.py):
- `"` only ever starts a piece (`"`, `":`, ` "`, `"}}`): it never prefixes a word nor ends
  a run of punctuation, so a line inside a JSON string argument, which starts after `"` and
  ends before `"`, keeps its first and last token;
- `|` never prefixes a word: in `read_file`'s `N|line` the line starts after `|`;
- punctuation does not absorb the newlines after it (`:\n`): in the observation a line ends
  before `\n`, in the call before `"`.
`python experiments/build_tokenizer.py` prints the share of code lines that copy exactly.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from jaxrl_agent.chat_template import CHAT_TEMPLATE, END_OF_TEXT
from jaxrl_agent.config import SYSTEM_PROMPT  # noqa: E402
from jaxrl_agent.env.expert import STYLES, run_expert  # noqa: E402
from jaxrl_agent.env.sandbox import Sandbox  # noqa: E402
from jaxrl_agent.env.tasks import generate_tasks, workspace_files  # noqa: E402
from jaxrl_agent.env.tools import ToolConfig, create_workspaces  # noqa: E402
from jaxrl_agent.tokenizer import DEFAULT_TOKENIZER_DIR, ChatFormat  # noqa: E402

SPLIT = (  # Qwen2's pattern with the three changes of the module docstring
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}"|]?\p{L}+|\p{N}| ?"[^\s\p{L}\p{N}"]*| ?[^\s\p{L}\p{N}"]+|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]
SEED_OFFSET = 7000
"""Training tasks come from `generate_tasks("train", n, seed + 7000)`: disjoint streams from
the study's demonstrations and drills (seed, seed + 100)."""


def episode_text(task, transcript, tool_style: str) -> str:
    """One expert transcript rendered exactly as the rollout renders an episode."""
    chat = ChatFormat(None, tool_style=tool_style)  # rendering only: no tokenizer needed
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]
    for k, (call, observation) in enumerate(transcript.turns):
        messages.append({"role": "assistant", "content": call})
        if k + 1 < len(transcript.turns):
            messages.append({"role": "tool", "content": observation})
    return chat.render(messages, chat.tool_schemas, add_generation_prompt=False) + END_OF_TEXT


def corpus(n_episodes: int, seed: int, workers: int = 2):
    """Expert episodes (style and tool style drawn per task) and the tasks' files, in task
    order; episodes play `workers` at a time (the test runs are the cost; nothing is judged:
    the text does not depend on the reward)."""
    tasks = generate_tasks("train", n_episodes, seed + SEED_OFFSET)
    rng = random.Random(seed)
    styles = STYLES[:6]  # the styles the shipped tokenizer was built from (later ones use the same formats)
    draws = [(rng.choice(["short", "full"]), rng.choice(styles), rng.random() < 0.3) for _ in tasks]
    with Sandbox(num_workers=workers) as sandbox, tempfile.TemporaryDirectory(prefix="jxa-tok-") as root, \
            ThreadPoolExecutor(workers) as pool:
        def play(i: int) -> str:
            tool_style, style, _ = draws[i]
            ws = create_workspaces(workspace_files(tasks[i]), os.path.join(root, str(i)), 1)[0]
            tr = run_expert(tasks[i], ws, sandbox, style, ToolConfig(test_timeout_s=0.05), tool_style,
                            judge=False)
            return episode_text(tasks[i], tr, tool_style)

        for i, text in enumerate(pool.map(play, range(len(tasks)))):
            yield text
            if draws[i][2]:  # the repository as it lies on disk
                t = tasks[i]
                yield "\n".join([*t.files.values(), *t.reference_files.values(), *t.dev_tests.values(),
                                 *t.hidden_tests.values()])


def build(vocab_size: int, n_episodes: int, seed: int, out: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_MARKERS), special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    # Markers are stripped from the training text: they become added tokens, not merges.
    def text():
        for doc in corpus(n_episodes, seed):
            for marker in SPECIAL + TOOL_MARKERS:
                doc = doc.replace(marker, "\n")
            yield doc

    tok.train_from_iterator(text(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_MARKERS])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"], clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    os.makedirs(out, exist_ok=True)
    hf_tok.save_pretrained(out)
    return hf_tok


def copy_share(hf_tok, tasks) -> float:
    """Share of the tasks' code lines (no quote or backslash, which JSON escapes) whose tokens
    in a `read_file` observation are the tokens of the same line as `replace_lines`' text."""
    from jaxrl_agent.env.tools import format_tool_call, numbered

    def piece(text: str, start: int, end: int) -> list[int] | None:
        enc = hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
        inside = [(i, s, e) for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]) if s >= start and e <= end]
        if not inside or inside[0][1] != start or inside[-1][2] != end or any(  # token edges = line edges
                a[2] != b[1] for a, b in zip(inside, inside[1:])):
            return None
        return [i for i, _, _ in inside]

    same = total = 0
    for task in tasks:
        for path, src in task.files.items():
            lines = src.splitlines()
            obs = f"<tool_response>\n{numbered(lines, 1, len(lines))}\n</tool_response>"
            at = len("<tool_response>\n")
            for k, line in enumerate(lines, 1):
                at += len(f"{k}|")
                if line.strip() and not {'"', "\\"} & set(line):
                    call = format_tool_call("replace_lines", {"path": path, "start": k, "end": k, "text": line})
                    c0 = call.index('"text": "') + len('"text": "')
                    a, b = piece(obs, at, at + len(line)), piece(call, c0, c0 + len(line))
                    total += 1
                    same += a is not None and a == b
                at += len(line) + 1
    return same / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=DEFAULT_TOKENIZER_DIR)
    args = ap.parse_args()
    hf_tok = build(args.vocab_size, args.episodes, args.seed, args.out)
    sample = next(corpus(1, args.seed + 1))
    ids = hf_tok.encode(sample, add_special_tokens=False)
    print(f"wrote {args.out}: {len(hf_tok)} tokens; sample episode {len(sample)} chars -> {len(ids)} tokens "
          f"({len(sample) / len(ids):.2f} chars/token)")
    for split in ("train", "heldout_instances", "heldout_templates"):
        print(f"{split}: {copy_share(hf_tok, generate_tasks(split, 40, 3)):.3f} of code lines copy exactly")


if __name__ == "__main__":
    main()
