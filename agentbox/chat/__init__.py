"""Conversations as text and back, in the API process: owns prompt rendering through the model's chat template
(render.py, template.py, tool_prompt.py, harmony.py for gpt-oss), tool-call parsers (tool_parsers/), the
reasoning split (reasoning.py), reasoning effort (effort.py) and the grammar a tool call must follow
(grammar.py). Plain functions over tokenizers and strings: no HTTP here, and the engine never imports it."""
