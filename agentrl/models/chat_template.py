"""The chat template every tiny preset ships (Jinja, Qwen2.5 / Hermes tool-call format).

One template serves text and vision presets: string content renders as is, a list of parts renders
text parts and turns image / video parts into `<|vision_start|><|image_pad|><|vision_end|>`
(the processor later expands each `<|image_pad|>` to the image's patch count).

Format (what transformers' and vLLM's `apply_chat_template` produce from the saved file):

    <|im_start|>system\n{system}[\n\n# Tools ... <tools>\n{schema}\n...</tools> ...]<|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n{content}[\n<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>]<|im_end|>\n
    <|im_start|>user\n<tool_response>\n{tool content}\n</tool_response><|im_end|>\n   (consecutive tool
                                                                                 messages share a turn)
    <|im_start|>assistant\n                                              (add_generation_prompt)

No default system prompt is added (prompts of the tiny models are short).
"""

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _jinja_str(text: str) -> str:
    """Quote a Python string as a Jinja string literal (single quotes, escaped newlines)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


CHAT_TEMPLATE = (
    """{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type in ['image', 'image_url'] or 'image' in part or 'image_url' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type in ['video', 'video_url'] or 'video' in part -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}
        {{- render_content(messages[0].content) + '\\n\\n' -}}
    {%- endif -%}
    {{- """
    + _jinja_str(TOOLS_PREAMBLE)
    + """ -}}
    {%- for tool in tools -%}
        {{- '\\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- """
    + _jinja_str(TOOLS_INSTRUCTIONS)
    + """ + '<|im_end|>\\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role in ['system', 'user'] or (message.role == 'assistant' and not message.tool_calls) -%}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant' -}}
        {%- if message.content -%}
            {{- '\\n' + render_content(message.content) -}}
        {%- endif -%}
        {%- for call in message.tool_calls -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('chat template: unknown message role ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""
)
