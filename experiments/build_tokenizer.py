"""HOST: rebuild the repo's tiny byte-level BPE tokenizer (jaxrl_agent/assets/tokenizer/).

    python experiments/build_tokenizer.py [--vocab-size 2048] [--docs 4000] [--seed 0] [--out DIR]

The corpus imitates what the tiny policies read and write: small Python algorithm modules
(binary search with `low = mid` / `high = mid` bugs, lower/upper bound, sliding windows, two
pointers, partitioning, clamping, merging, chunking ...) in correct and buggy variants with
randomised identifiers, their pytest files and pytest output, and whole ChatML episodes with
Hermes tool calls (`list_files`, `read_file`, `str_replace`, `run_tests`, `submit`) and tool
responses. It is generated here from a seed, so the tokenizer is reproducible and does not
depend on the task package. Pre-tokenization is Qwen2's (digits split one by one, runs of
spaces kept together for indentation), then byte-level BPE; ChatML and tool-call markers are
added tokens, so each is one id.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from jaxrl_agent.tokenizer import (  # noqa: E402
    CHAT_TEMPLATE, DEFAULT_TOKENIZER_DIR, format_tool_call, render_chat, short_tool_prompt,
)

QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]

TOOLS = [
    {"type": "function", "function": {"name": "list_files", "description": "List the files of the repository.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file with numbered lines.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "start_line": {"type": "integer"},
                                          "end_line": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "str_replace", "description": "Replace a unique string in a file.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "old": {"type": "string"},
                                          "new": {"type": "string"}}, "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the dev tests.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {"name": "submit", "description": "Submit the repository.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
]

# ---- algorithm module templates: (name, correct source, [(good, buggy) substitutions]) ----

ALGORITHMS = [
    ("binary_search", '''def {fn}({xs}, {key}):
    """Return the index of {key} in the sorted list {xs}, or -1."""
    {lo}, {hi} = 0, len({xs}) - 1
    while {lo} <= {hi}:
        {mid} = ({lo} + {hi}) // 2
        if {xs}[{mid}] == {key}:
            return {mid}
        if {xs}[{mid}] < {key}:
            {lo} = {mid} + 1
        else:
            {hi} = {mid} - 1
    return -1
''', [("{lo} = {mid} + 1", "{lo} = {mid}"), ("{hi} = {mid} - 1", "{hi} = {mid}"), ("{lo} <= {hi}", "{lo} < {hi}")]),
    ("lower_bound", '''def {fn}({xs}, {key}):
    """First index i with {xs}[i] >= {key} (len({xs}) if none)."""
    {lo}, {hi} = 0, len({xs})
    while {lo} < {hi}:
        {mid} = ({lo} + {hi}) // 2
        if {xs}[{mid}] < {key}:
            {lo} = {mid} + 1
        else:
            {hi} = {mid}
    return {lo}
''', [("{xs}[{mid}] < {key}", "{xs}[{mid}] <= {key}"), ("{lo} = {mid} + 1", "{lo} = {mid}"), ("len({xs})\n", "len({xs}) - 1\n")]),
    ("upper_bound", '''def {fn}({xs}, {key}):
    """First index i with {xs}[i] > {key} (len({xs}) if none)."""
    {lo}, {hi} = 0, len({xs})
    while {lo} < {hi}:
        {mid} = {lo} + ({hi} - {lo}) // 2
        if {xs}[{mid}] <= {key}:
            {lo} = {mid} + 1
        else:
            {hi} = {mid}
    return {lo}
''', [("{xs}[{mid}] <= {key}", "{xs}[{mid}] < {key}"), ("{hi} = {mid}\n", "{hi} = {mid} - 1\n")]),
    ("max_window_sum", '''def {fn}({xs}, {k}):
    """Largest sum of {k} consecutive items of {xs}."""
    if {k} <= 0 or {k} > len({xs}):
        raise ValueError("window size out of range")
    {acc} = sum({xs}[:{k}])
    {best} = {acc}
    for {i} in range({k}, len({xs})):
        {acc} += {xs}[{i}] - {xs}[{i} - {k}]
        {best} = max({best}, {acc})
    return {best}
''', [("range({k}, len({xs}))", "range({k}, len({xs}) - 1)"), ("{xs}[{i} - {k}]", "{xs}[{i} - {k} + 1]"), ("{k} > len({xs})", "{k} >= len({xs})")]),
    ("pair_with_sum", '''def {fn}({xs}, {key}):
    """Indices (i, j), i < j, of a pair in the sorted {xs} summing to {key}, or None."""
    {lo}, {hi} = 0, len({xs}) - 1
    while {lo} < {hi}:
        {acc} = {xs}[{lo}] + {xs}[{hi}]
        if {acc} == {key}:
            return ({lo}, {hi})
        if {acc} < {key}:
            {lo} += 1
        else:
            {hi} -= 1
    return None
''', [("{lo} < {hi}:", "{lo} <= {hi}:"), ("{lo} += 1", "{hi} -= 1"), ("len({xs}) - 1", "len({xs}) - 2")]),
    ("partition", '''def {fn}({xs}, {key}):
    """Stable split of {xs} into (items < {key}, items >= {key})."""
    {left} = []
    {right} = []
    for {item} in {xs}:
        if {item} < {key}:
            {left}.append({item})
        else:
            {right}.append({item})
    return {left}, {right}
''', [("{item} < {key}", "{item} <= {key}"), ("return {left}, {right}", "return {right}, {left}")]),
    ("clamp", '''def {fn}({item}, {lo}, {hi}):
    """{item} limited to the closed range [{lo}, {hi}]."""
    if {lo} > {hi}:
        raise ValueError("empty range")
    if {item} < {lo}:
        return {lo}
    if {item} > {hi}:
        return {hi}
    return {item}
''', [("if {item} > {hi}:\n        return {hi}", "if {item} >= {hi}:\n        return {lo}"), ("{lo} > {hi}", "{lo} >= {hi}")]),
    ("merge_sorted", '''def {fn}({left}, {right}):
    """Merge two sorted lists into one sorted list."""
    {out} = []
    {i}, {j} = 0, 0
    while {i} < len({left}) and {j} < len({right}):
        if {left}[{i}] <= {right}[{j}]:
            {out}.append({left}[{i}])
            {i} += 1
        else:
            {out}.append({right}[{j}])
            {j} += 1
    {out}.extend({left}[{i}:])
    {out}.extend({right}[{j}:])
    return {out}
''', [("{out}.extend({right}[{j}:])\n", ""), ("{left}[{i}] <= {right}[{j}]", "{left}[{i}] < {right}[{j}] - 1")]),
    ("chunk", '''def {fn}({xs}, {k}):
    """Split {xs} into consecutive lists of {k} items (the last may be shorter)."""
    if {k} < 1:
        raise ValueError("chunk size must be positive")
    return [{xs}[{i}:{i} + {k}] for {i} in range(0, len({xs}), {k})]
''', [("range(0, len({xs}), {k})", "range(0, len({xs}) - {k}, {k})"), ("{k} < 1", "{k} < 0")]),
    ("count_in_range", '''def {fn}({xs}, {lo}, {hi}):
    """Number of items x of the sorted {xs} with {lo} <= x <= {hi}."""
    {left} = bisect_left({xs}, {lo})
    {right} = bisect_right({xs}, {hi})
    return max(0, {right} - {left})
''', [("bisect_right({xs}, {hi})", "bisect_left({xs}, {hi})"), ("{right} - {left}", "{right} - {left} - 1")]),
]

NAMES = {
    "xs": ["xs", "arr", "items", "values", "nums", "data", "seq", "sorted_values", "numbers", "elements"],
    "key": ["target", "key", "goal", "value", "needle", "query", "wanted", "x"],
    "lo": ["low", "lo", "left", "start", "first", "begin"],
    "hi": ["high", "hi", "right", "end", "last", "stop"],
    "mid": ["mid", "middle", "m", "pivot", "center", "half"],
    "k": ["k", "size", "width", "window", "n", "step"],
    "acc": ["total", "acc", "current", "s", "window_sum", "running"],
    "best": ["best", "result", "max_sum", "answer", "top"],
    "i": ["i", "idx", "index", "pos", "j"],
    "j": ["j", "jdx", "other", "q"],
    "item": ["item", "x", "value", "element", "v"],
    "left": ["left", "lower", "small", "a", "head"],
    "right": ["right", "upper", "large", "b", "tail"],
    "out": ["out", "merged", "result", "res", "combined"],
}
MODULES = ["search", "bounds", "window", "pairs", "split", "limits", "merge", "chunks", "ranges", "algo", "utils", "core"]


def _fill(template: str, names: dict) -> str:
    return template.format(**names)


def make_module(rng: random.Random) -> tuple[str, str, str, str]:
    """(file path, correct source, buggy source, function name) for one random algorithm."""
    name, src, bugs = rng.choice(ALGORITHMS)
    names = {k: rng.choice(v) for k, v in NAMES.items()}
    # distinct identifiers for the roles that appear together
    taken = set()
    for role in ("xs", "key", "lo", "hi", "mid", "k", "acc", "best", "i", "j", "item", "left", "right", "out"):
        while names[role] in taken:
            names[role] = rng.choice(NAMES[role]) + "_" + rng.choice("abcxyz")
        taken.add(names[role])
    names["fn"] = rng.choice([name, name + "_" + rng.choice(["v2", "impl", "fast", "safe"]), "find_" + name.split("_")[-1]])
    header = "from bisect import bisect_left, bisect_right\n\n\n" if "bisect" in src else ""
    good = header + _fill(src, names)
    buggy = good
    for g, b in rng.sample(bugs, k=rng.randint(1, min(2, len(bugs)))):
        buggy = buggy.replace(_fill(g, names), _fill(b, names), 1)
    path = rng.choice(["", "src/", "lib/", "pkg/"]) + rng.choice(MODULES) + ".py"
    return path, good, buggy, names["fn"]


def make_tests(rng: random.Random, path: str, fn: str) -> tuple[str, str]:
    module = path[:-3].replace("/", ".")
    tests = [f"from {module} import {fn}\n"]
    names = []
    for t in range(rng.randint(2, 5)):
        args = sorted(rng.sample(range(-20, 60), rng.randint(0, 8)))
        arg2 = rng.randint(-5, 40)
        tname = f"test_{fn}_{rng.choice(['basic', 'empty', 'edge', 'first', 'last', 'missing', 'single', 'duplicates'])}_{t}"
        names.append(tname)
        tests.append(f"\n\ndef {tname}():\n    assert {fn}({args}, {arg2}) == {rng.randint(-1, 9)}\n")
    return "tests/test_" + os.path.basename(path), "".join(tests), names


def pytest_output(rng: random.Random, test_path: str, names: list[str], fn: str) -> str:
    failed = [n for n in names if rng.random() < 0.4]
    marks = "".join("F" if n in failed else "." for n in names)
    lines = ["============================= test session starts ==============================",
             f"collected {len(names)} items", "", f"{test_path} {marks}" + " " * 8 + "[100%]"]
    if failed:
        lines += ["", "=================================== FAILURES ===================================",
                  f"_________________________________ {failed[0]} _________________________________",
                  f"    def {failed[0]}():", f">       assert {fn}([1, 3, 5, 7], {rng.randint(0, 9)}) == {rng.randint(-1, 4)}",
                  f"E       assert {rng.randint(-1, 4)} == {rng.randint(-1, 4)}",
                  f"E        +  where {rng.randint(-1, 4)} = {fn}([1, 3, 5, 7], {rng.randint(0, 9)})", "",
                  f"{test_path}:{rng.randint(3, 30)}: AssertionError",
                  "=========================== short test summary info ============================"]
        lines += [f"FAILED {test_path}::{n} - assert {rng.randint(-1, 4)} == {rng.randint(-1, 4)}" for n in failed]
    passed = len(names) - len(failed)
    summary = ", ".join(s for s in [f"{len(failed)} failed" if failed else "", f"{passed} passed" if passed else ""] if s)
    lines.append(f"========================= {summary} in 0.{rng.randint(1, 99):02d}s =========================")
    if rng.random() < 0.1:
        lines = [f"Error: tests timed out after {rng.choice([5, 10, 30])} seconds (possible infinite loop in {fn})"]
    return "\n".join(lines)


def numbered(src: str, start: int = 1) -> str:
    return "\n".join(f"{i:>4}  {line}" for i, line in enumerate(src.splitlines(), start))


def call(name: str, **arguments) -> str:
    return format_tool_call(name, arguments)


def episode(rng: random.Random) -> str:
    """One ChatML agent episode: system, task, tool calls and tool responses."""
    path, good, buggy, fn = make_module(rng)
    test_path, test_src, names = make_tests(rng, path, fn)
    system = "You are a coding agent. Fix the bug so that all tests pass, then submit."
    short = rng.random() < 0.5  # both system prompt styles of ChatFormat
    if short:
        system += "\n\n" + short_tool_prompt(TOOLS)
    parts = [render_chat([{"role": "system", "content": system}], None if short else TOOLS),
             f"<|im_start|>user\nThe function `{fn}` in {path} has a bug. Fix it and make the tests pass.<|im_end|>\n"]

    def turn(thought: str, tool_call: str, response: str):
        text = (thought + "\n" if thought else "") + tool_call
        parts.append(f"<|im_start|>assistant\n{text}<|im_end|>\n")
        parts.append(f"<|im_start|>user\n<tool_response>\n{response}\n</tool_response><|im_end|>\n")

    turn(rng.choice(["", "Let me look at the files.", "First, list the repository."]), call("list_files"),
         "\n".join(sorted([path, test_path, "README.md"] + rng.sample(["setup.cfg", "pyproject.toml", "conftest.py"], 1))))
    turn(rng.choice(["", f"I will read {path}."]), call("read_file", path=path), numbered(buggy))
    if rng.random() < 0.5:
        turn("", call("run_tests"), pytest_output(rng, test_path, names, fn))
    diff = [(b, g) for b, g in zip(buggy.splitlines(), good.splitlines()) if b != g]
    for old, new in diff[:2]:
        turn(rng.choice(["", "The loop bound is wrong.", "This line is the bug.", f"Fix `{old.strip()}`."]),
             call("str_replace", path=path, old=old.strip(), new=new.strip()),
             rng.choice([f"Replaced 1 occurrence in {path}.", "OK", f"Error: old string not found in {path}"]))
    turn("", call("run_tests"), pytest_output(rng, test_path, names, fn))
    if rng.random() < 0.3:
        turn("", call("read_file", path=test_path, start_line=1, end_line=12), numbered(test_src))
    parts.append(f"<|im_start|>assistant\n{call('submit')}<|im_end|>\n")
    return "".join(parts) + "<|endoftext|>"


def corpus(n_docs: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n_docs):
        r = rng.random()
        if r < 0.6:
            yield episode(rng)
        else:  # bare source and test files, as they appear on disk
            path, good, buggy, fn = make_module(rng)
            yield (good if r < 0.75 else buggy) + "\n" + make_tests(rng, path, fn)[1]


def build(vocab_size: int, n_docs: int, seed: int, out: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_MARKERS), special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Markers are stripped from the training text: they become added tokens, not merges.
    def text():
        for doc in corpus(n_docs, seed):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=DEFAULT_TOKENIZER_DIR)
    args = ap.parse_args()
    hf_tok = build(args.vocab_size, args.docs, args.seed, args.out)
    sample = next(corpus(1, args.seed + 1))
    ids = hf_tok.encode(sample, add_special_tokens=False)
    print(f"wrote {args.out}: {len(hf_tok)} tokens; sample episode {len(sample)} chars -> {len(ids)} tokens "
          f"({len(sample) / len(ids):.2f} chars/token)")


if __name__ == "__main__":
    main()
