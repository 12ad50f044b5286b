"""Chat templates (Jinja) in each family's real style, written for this project.

What each renders for [system "S", user "Hi"] with add_generation_prompt:

    llama3   <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\nS<|eot_id|>
             <|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|>
             <|start_header_id|>assistant<|end_header_id|>\\n\\n
    chatml   <|im_start|>system\\nS<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n
    mistral  <s>[INST] S\\n\\nHi[/INST]
    phi3     <|system|>\\nS<|end|>\\n<|user|>\\nHi<|end|>\\n<|assistant|>\\n
    gemma    <bos><start_of_turn>user\\nS\\n\\nHi<end_of_turn>\\n<start_of_turn>model\\n
"""

LLAMA3 = """\
{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen2 style: a default system turn when the conversation has none.
CHATML = """\
{%- if not messages or messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral v0.3 style: the system prompt goes inside the last user turn.
MISTRAL = """\
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set last = namespace(user=-1) %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}{%- set last.user = loop.index0 %}{%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' and loop.index0 == last.user and system_message %}
        {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] | trim + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported after an optional system message.') }}
    {%- endif %}
{%- endfor %}
"""

# Phi-3 style: role tags, each turn closed by <|end|>.
PHI3 = """\
{%- for message in messages %}
    {{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- else %}
    {{- eos_token }}
{%- endif %}
"""

# Gemma style: no system role (a system prompt is put before the first user turn); "model" answers.
GEMMA = """\
{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set first = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""
