"""A GLM-4.7-style chat template in brief (its tool block, role tags and the opened <think>) and its special
tokens: the scripted GLM server test and the incremental-tokenization property test share it."""

TEMPLATE = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# Tools\n\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools>\n\nFor each function call, output the function name and arguments within the following "
    "XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "...</tool_call>{%- endif -%}"
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content if m.content is string else '' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"
)
SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
