"""HOST: the chat text an episode is written in: ChatML with Hermes tool calls, the text
Qwen2.5's own chat template produces, so a pretrained Qwen-family checkpoint speaks it without
a custom template. No tokenizer here (tokenizer.py renders through this).

    <|im_start|>system\n{system}[\n\n# Tools ... <tools>{schemas}</tools> ...]<|im_end|>\n
    <|im_start|>user\n{task}<|im_end|>\n
    <|im_start|>assistant\n...<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\n

Tool results are `tool`-role messages; like Qwen2.5 they render inside a `user` turn, and
consecutive tool messages share one turn. Tool schemas are OpenAI function-format dicts
supplied by the caller; `tool_style="full"` renders them as Qwen2.5 does, `"short"` lists
only tool and argument names (`short_tool_prompt`: for tiny models, keeps episodes short).
The same text three ways, kept equal by tests/test_tokenizer.py: `render_chat` (Python),
`CHAT_TEMPLATE` (Jinja, for `apply_chat_template`), `RESPONSE_TEMPLATE` (parsing a turn back).
"""
from __future__ import annotations

import json
from typing import Sequence

from jaxrl_agent.env.tool_calls import format_tool_call

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
DEFAULT_SYSTEM = "You are a helpful assistant."

_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# The same text as `render_chat`, as a Jinja chat template (Qwen2.5's, with a neutral default
# system message); saved with the repo tokenizer so `apply_chat_template` agrees with us.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- " + json.dumps(_TOOLS_HEADER) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(_TOOLS_FOOTER + "<|im_end|>\n") + " }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def short_tool_prompt(tools: Sequence[dict]) -> str:
    """Tool names and argument names only (optional ones marked `?`), plus the call format.

    `tools` are OpenAI function-format dicts: `{"type": "function", "function": {"name",
    "description", "parameters": {"properties": {...}, "required": [...]}}}` (the bare
    `function` dict is accepted too).
    """
    lines = []
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters", {}) or {}
        required = set(params.get("required", []))
        args = [a if a in required else a + "?" for a in params.get("properties", {})]
        lines.append(f"- {fn['name']}({', '.join(args)})")
    return (
        "# Tools\n" + "\n".join(lines) + "\nCall a tool with:\n"
        + format_tool_call("<tool-name>", {"<arg>": "<value>"}).replace('"<tool-name>"', "<tool-name>")
    )


def render_chat(messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False) -> str:
    """Render messages exactly as Qwen2.5's chat template does (see `CHAT_TEMPLATE`).

    Args:
      messages: dicts with `role` (system/user/assistant/tool) and `content`; an assistant
        message may carry structured `tool_calls` ({"function": {"name", "arguments"}}).
      tools: OpenAI function-format schemas rendered into the system turn, or None.
      add_generation_prompt: end with `<|im_start|>assistant\\n`.
    Returns:
      The prompt text. Without a leading system message, `DEFAULT_SYSTEM` is used.
    """
    out = []
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else DEFAULT_SYSTEM
    if tools:
        schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        out.append(f"{IM_START}system\n{system}{_TOOLS_HEADER}{schemas}{_TOOLS_FOOTER}{IM_END}\n")
    else:
        out.append(f"{IM_START}system\n{system}{IM_END}\n")
    for i, msg in enumerate(messages):
        role, content = msg["role"], msg.get("content") or ""
        if role == "system" and i == 0:
            continue
        if role in ("user", "system") or (role == "assistant" and not msg.get("tool_calls")):
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        elif role == "assistant":
            out.append(f"{IM_START}assistant" + (f"\n{content}" if content else ""))
            for call in msg["tool_calls"]:
                call = call.get("function", call)
                out.append("\n" + format_tool_call(call["name"], call["arguments"]))
            out.append(f"{IM_END}\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append(f"{IM_START}user")
            out.append(f"\n{TOOL_RESPONSE}\n{content}\n{TOOL_RESPONSE_END}")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                out.append(f"{IM_END}\n")
        else:
            raise ValueError(f"message {i}: unknown role {role!r} (system, user, assistant, tool)")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


# How an assistant turn of CHAT_TEMPLATE parses back into a message: transformers'
# `response_template` (`tokenizer.parse_response`), saved in tokenizer_config.json with every
# tokenizer that speaks our template. TRL's tool path and other harnesses read the model's tool
# calls through it; without it TRL refuses a template it does not know ("Unrecognized chat
# template, failed to add response schema"). Tool calls are JSON between <tool_call> tags, the
# rest of the turn up to <|im_end|> is content (the layout of Qwen2.5 / Qwen3 without reasoning).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
