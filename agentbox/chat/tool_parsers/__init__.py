"""Tool-call parsers by model family, chosen by name (the model profile) or from the chat template."""

from __future__ import annotations

from agentbox.chat.tool_parsers.base import (
    Delta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStream,
    collect,
    new_call_id,
)
from agentbox.chat.tool_parsers.dsml import DsmlParser
from agentbox.chat.tool_parsers.gemma4 import Gemma4Parser
from agentbox.chat.tool_parsers.harmony import HarmonyToolParser
from agentbox.chat.tool_parsers.json_family import HermesParser, Llama3JsonParser, MistralParser
from agentbox.chat.tool_parsers.xml_family import Glm45Parser, Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (HermesParser, Qwen3CoderParser, Glm45Parser, Llama3JsonParser, MistralParser, HarmonyToolParser,
              Gemma4Parser, DsmlParser)
}
ALIASES = {"gpt_oss": "openai", "harmony": "openai", "qwen25": "hermes", "qwen2_5": "hermes", "qwen3": "hermes", "glm47": "glm45", "llama3": "llama3_json",
           "deepseek_v32": "deepseek_v4", "dsml": "deepseek_v4"}


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[key](tools)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The family whose call syntax the template teaches the model; None when it teaches none.

    The order matters: Qwen3-Coder and GLM templates also contain `<tool_call>`, so their own markers
    are checked before the hermes one.
    """
    t = chat_template or ""
    if "<|channel|>" in t and "commentary" in t:  # harmony (gpt-oss): calls go to the commentary channel
        return "openai"
    if "｜DSML｜" in t:  # DeepSeek-V3.2 / V4
        return "deepseek_v4"
    if "<|tool_call>call:" in t:  # Gemma 4
        return "gemma4"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<arg_key>" in t:
        return "glm45"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ('"parameters"' in t and "ipython" in t):
        return "llama3_json"
    return None


__all__ = [
    "ALIASES",
    "PARSERS",
    "Delta",
    "ParsedOutput",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStream",
    "collect",
    "detect_tool_parser",
    "get_tool_parser",
    "new_call_id",
]
