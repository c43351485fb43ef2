"""HOST: tokenizer wrapper, the chat format an episode is rendered in, and the incremental
token-in / token-out episode builder (DESIGN §3, §7).

    text --Tokenizer.encode / decode (exact inverses, no BOS/EOS)--> ids
    messages --ChatFormat.render (chat_template.render_chat, or the tokenizer's own template)--> text
    EpisodeBuilder: prompt ids, sampled ids verbatim (loss_mask 1), observation ids (loss_mask 0), ...

The chat text itself (ChatML with Hermes tool calls, as Qwen2.5's template writes it; the
"full" and "short" tool styles) is chat_template.py's.

The episode builder never re-tokenizes sampled text: an episode is the prompt ids, then
sampled ids verbatim (loss_mask 1), then the ids of the rendered observation text (loss_mask
0), and so on. The observation text is the chat template's rendering of the conversation with
the new tool messages, minus the text already in the episode; if the template's rendering
does not extend that text (a template that rewrites history), `PrefixError` is raised.
"""
from __future__ import annotations

import os
import re
from typing import Sequence

from tokenizers import Tokenizer as _Backend

from jaxrl_agent.chat_template import (CHAT_TEMPLATE, DEFAULT_SYSTEM, END_OF_TEXT, IM_END, IM_START, RESPONSE_TEMPLATE,
                                       render_chat, short_tool_prompt)
from jaxrl_agent.env.tool_calls import TOOL_SETS, tool_schemas

DEFAULT_TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "assets", "tokenizer")


class PrefixError(ValueError):
    """The chat template's rendering does not extend the tokens the model conditioned on."""


# ---- tokenizer wrapper ---------------------------------------------------------------------


def _transformers():
    """transformers, imported on first need (exporting, its chat template, "auto" mode): its
    import (`python -X importtime -c "import transformers"`) would lengthen every start-up,
    which tokenizes with `tokenizers` alone. In a runtime install
    (JAX, no torch) it logs "PyTorch was not found ..." when imported: advice about its own
    models, which this package never builds; silenced for this import only, unless the user set
    the switch themselves (tests/test_tokenizer.py)."""
    advice = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    quiet = advice not in os.environ
    if quiet:
        os.environ[advice] = "1"
    try:
        import transformers
    finally:
        if quiet:
            del os.environ[advice]
    return transformers


class Tokenizer:
    """A Hugging Face tokenizer with the ids and conventions the agent loop needs.

    `encode` never adds BOS/EOS (chat text carries its own markers); `decode` keeps special
    tokens and never "cleans up" spaces, so decoding is the exact inverse for byte-level BPE.
    Made from a `transformers` tokenizer, or (`load_tokenizer` in "file" mode) from a
    directory's tokenizer.json read by `tokenizers`, with the `transformers` object (`.hf`:
    chat template, saving) built from the directory when first asked for.
    """

    def __init__(self, hf_tokenizer=None, *, directory: str | None = None):
        if (hf_tokenizer is None) == (directory is None):
            raise ValueError("Tokenizer takes a transformers tokenizer or a directory holding tokenizer.json")
        self._hf, self._directory = hf_tokenizer, directory
        if hf_tokenizer is not None:
            self._backend = hf_tokenizer.backend_tokenizer
        else:
            self._backend = _Backend.from_file(os.path.join(directory, "tokenizer.json"))
            self._backend.no_truncation()  # as transformers calls it: whole texts, no padding
            self._backend.no_padding()
        self._vocab = vocab = self._backend.get_vocab(with_added_tokens=True)
        missing = [t for t in (IM_START, IM_END) if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer has no {missing} token(s): it cannot render ChatML")
        self.im_start_id = vocab[IM_START]
        self.im_end_id = vocab[IM_END]
        self.pad_id = vocab.get(END_OF_TEXT, self.im_end_id)
        # A turn ends at <|im_end|>; <|endoftext|> also stops generation when present.
        self.stop_ids = tuple(sorted({self.im_end_id, vocab.get(END_OF_TEXT, self.im_end_id)}))
        added = sorted(self.added_vocab(), key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        if hf_tokenizer is not None:
            _with_response_template(hf_tokenizer)

    @property
    def hf(self):
        """The `transformers` tokenizer (made from the directory on first use). From then on it
        is what encodes and decodes, as for a tokenizer made from one: a change made through it
        (`tok.hf.add_tokens(...)`) is a change of this tokenizer."""
        if self._hf is None:
            self._hf = _with_response_template(
                _transformers().PreTrainedTokenizerFast.from_pretrained(self._directory))
            self._backend = self._hf.backend_tokenizer
        return self._hf

    def added_vocab(self) -> dict[str, int]:
        """Added tokens (`<|im_end|>`, `<tool_call>`, ...) -> id, as `get_added_vocab`."""
        return {t.content: i for i, t in sorted(self._backend.get_added_tokens_decoder().items())}

    def escape(self, text: str) -> str:
        """`text` with every added-token string (`<|im_end|>`, `</tool_response>`, ...) broken
        by a zero-width space after its first character, so it encodes as plain text.

        Untrusted text (tool output, a task file's instruction) goes through this before it
        is rendered into an episode: program output can then never become a special id and
        forge a turn boundary or a tool response (the threat model of env/sandbox.py)."""
        if self._added is None:
            return text
        while self._added.search(text):  # a break can never form a new match; loop for safety
            text = self._added.sub(lambda m: m.group(0)[0] + "\u200b" + m.group(0)[1:], text)
        return text

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (`len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Text -> ids; special-token strings in `text` become their single ids."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens kept, no whitespace clean-up."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        """The id of a single-token string (e.g. "<tool_call>"); KeyError if not one token."""
        if token not in self._vocab:
            raise KeyError(f"{token!r} is not a single token of this tokenizer")
        return self._vocab[token]


def has_tokenizer_files(path: str) -> bool:
    """Whether directory `path` holds an HF tokenizer (tokenizer.json or tokenizer_config.json)."""
    return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


TOKENIZER_MODES = ("auto", "file")


def load_tokenizer(path: str | None = None, mode: str = "file") -> Tokenizer:
    """Load a local HF tokenizer directory (default: the repo's tiny tokenizer).

    `mode` "file" (default): tokenizer.json as written (`PreTrainedTokenizerFast`), so a
    policy is served with the tokenizer it was trained with. "auto": what `AutoTokenizer`
    builds from the directory. For a directory whose config.json says qwen2 (every exported
    policy) that is `Qwen2Tokenizer`, which replaces tokenizer.json's pre-tokenizer with
    Qwen2's and adds an NFC normalizer: not the tokenizer our SFT trained with (the repo's, as
    its file says; experiments/binary_search_rl/README.md). For a real Qwen2 checkpoint the two
    agree; "auto" is for directories with no tokenizer.json (slow tokenizers)."""
    path = path or DEFAULT_TOKENIZER_DIR
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer mode {mode!r}: one of {TOKENIZER_MODES}")
    if not has_tokenizer_files(path):
        raise FileNotFoundError(f"no tokenizer.json / tokenizer_config.json in {path}")
    if mode == "file":
        if not os.path.exists(os.path.join(path, "tokenizer.json")):
            raise FileNotFoundError(f"tokenizer mode 'file' reads {path}/tokenizer.json, which is missing: "
                                    "use mode 'auto' (--policy.tokenizer=auto) to let transformers build it")
        return Tokenizer(directory=path)
    return Tokenizer(_transformers().AutoTokenizer.from_pretrained(path))


def _with_response_template(hf_tokenizer):
    """Our chat template's calls parse back (and export so): its response template set."""
    if hf_tokenizer.chat_template == CHAT_TEMPLATE and getattr(hf_tokenizer, "response_template", None) is None:
        hf_tokenizer.response_template = RESPONSE_TEMPLATE
    return hf_tokenizer


# ---- chat format ----------------------------------------------------------------------------


class ChatFormat:
    """How an episode's text is rendered: built-in ChatML renderer or the tokenizer's template.

    Args:
      tokenizer: the `Tokenizer`.
      tool_style: "full" (schemas in the system turn, as Qwen2.5) or "short" (names only, via
        `short_tool_prompt`, appended to the system message; for tiny models). The style also
        picks the tool set (`tool_schemas`): "full" edits with `str_replace`, "short" with the
        line-addressed `replace_lines` (env/tool_calls.py says why).
      use_tokenizer_template: render with `tokenizer.hf.apply_chat_template` instead of
        `render_chat` (for a pretrained checkpoint's own template).
    """

    def __init__(self, tokenizer: Tokenizer, tool_style: str = "full", use_tokenizer_template: bool = False):
        if tool_style not in TOOL_SETS:
            raise ValueError(f"tool_style must be one of {sorted(TOOL_SETS)}, got {tool_style!r}")
        self.tokenizer, self.tool_style, self.use_tokenizer_template = tokenizer, tool_style, use_tokenizer_template
        self.tool_schemas = tool_schemas(tool_style)
        """The tools this style offers (pass them to `EpisodeBuilder` and `ToolSession`)."""
        self.tool_names = TOOL_SETS[tool_style]

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None, add_generation_prompt: bool) -> str:
        """The conversation text (see `render_chat`)."""
        messages = list(messages)
        if tools and self.tool_style != "full":
            has_system = bool(messages) and messages[0]["role"] == "system"
            system = messages[0]["content"] if has_system else DEFAULT_SYSTEM
            messages = [{"role": "system", "content": f"{system}\n\n{short_tool_prompt(tools)}"}] + messages[int(has_system):]
            tools = None
        if self.use_tokenizer_template:
            return self.tokenizer.hf.apply_chat_template(
                messages, tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return render_chat(messages, tools, add_generation_prompt)


# ---- the incremental episode builder -------------------------------------------------------


class EpisodeBuilder:
    """Builds one episode's token sequence by appending only (DESIGN §3).

    Per token it records `ids`, `loss_mask` (1 on sampled ids), `sampler_logp` (the sampler's
    log-prob on sampled ids, 0 elsewhere) and `turn_id`: turn k is the context rendered
    before the k-th sampled response (the prompt for k = 0, the k-th observation otherwise)
    plus that response.

    Args:
      chat: the `ChatFormat` (tokenizer, tool style, renderer).
      messages: the initial messages (system, user task).
      tools: tool schemas rendered with the system turn, or None.
    """

    def __init__(self, chat: ChatFormat, messages: Sequence[dict], tools: Sequence[dict] | None = None):
        self.chat, self.tools = chat, tools
        # user and tool text is untrusted (a task file, program output): never special ids
        self.messages = [dict(m, content=chat.tokenizer.escape(m.get("content") or "")) if m["role"] in ("user", "tool")
                         else dict(m) for m in messages]
        self._text = chat.render(self.messages, tools, add_generation_prompt=True)
        self.ids: list[int] = []
        self.loss_mask: list[int] = []
        self.sampler_logp: list[float] = []
        self.turn_id: list[int] = []
        self.turn = 0
        self._append(chat.tokenizer.encode(self._text), None)
        self.prompt_len = len(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def _append(self, ids: Sequence[int], logps: Sequence[float] | None) -> None:
        self.ids.extend(int(i) for i in ids)
        self.loss_mask.extend([0 if logps is None else 1] * len(ids))
        self.sampler_logp.extend([0.0] * len(ids) if logps is None else [float(x) for x in logps])
        self.turn_id.extend([self.turn] * len(ids))

    def append_sampled(self, ids: Sequence[int], logps: Sequence[float], *, context: Sequence[int] | int | None = None) -> None:
        """Append the sampler's ids verbatim (loss_mask 1) with their log-probs.

        Args:
          ids: sampled ids of one assistant response, stop token included if one was sampled.
          logps: the sampler's log-prob of each id (same length).
          context: what the sampler conditioned on: the ids, or their count (cache length).
            Checked against the episode so far (the prefix property); None skips the check.
        Raises:
          PrefixError if `context` is not the episode so far; ValueError on a length mismatch.
        """
        if len(ids) != len(logps):
            raise ValueError(f"append_sampled: {len(ids)} ids but {len(logps)} logps")
        if context is not None:
            n = context if isinstance(context, int) else len(context)
            if n != len(self.ids) or (not isinstance(context, int) and list(context) != self.ids):
                raise PrefixError(
                    f"prefix property violated: the sampler conditioned on {n} tokens that are not "
                    f"the episode's {len(self.ids)} tokens"
                )
        self._append(ids, logps)
        text = self.chat.tokenizer.decode(ids)
        self._text += text
        # The template renders the assistant message as content + <|im_end|>, so the stop
        # token is not part of the content; a truncated response simply has no <|im_end|>.
        content = text[: -len(IM_END)] if text.endswith(IM_END) else text
        self.messages.append({"role": "assistant", "content": content})

    def append_observation(self, tool_responses: str | Sequence[str]) -> list[int]:
        """Append tool results as `tool` messages plus the chat glue up to the next assistant
        turn, all with loss_mask 0. Returns the appended ids. The results pass through
        `Tokenizer.escape`: whatever they contain encodes as plain text, never a special id.

        The appended text is `render(messages + tools results, generation prompt)` minus the
        text already in the episode: this covers the junction newline after `<|im_end|>` and
        closes a response that was cut before its `<|im_end|>`.

        Raises:
          PrefixError when the rendering does not start with the episode's text.
        """
        if isinstance(tool_responses, str):
            tool_responses = [tool_responses]
        if not tool_responses:
            raise ValueError("append_observation: no tool responses")
        self.turn += 1
        escape = self.chat.tokenizer.escape  # program output must never become special ids
        messages = self.messages + [{"role": "tool", "content": escape(r)} for r in tool_responses]
        full = self.chat.render(messages, self.tools, add_generation_prompt=True)
        if not full.startswith(self._text):
            at = next((i for i, (a, b) in enumerate(zip(full, self._text)) if a != b), min(len(full), len(self._text)))
            lo = max(0, at - 20)  # show a little shared context before the divergence
            raise PrefixError(
                f"prefix property violated at turn {self.turn}: the chat template re-renders the "
                f"conversation differently from the tokens already in the episode, at character "
                f"{at}: episode has {self._text[lo:at + 40]!r}, template gives {full[lo:at + 40]!r}"
            )
        delta = full[len(self._text):]
        ids = self.chat.tokenizer.encode(delta)
        self._append(ids, None)
        self._text = full
        self.messages = messages
        return ids
