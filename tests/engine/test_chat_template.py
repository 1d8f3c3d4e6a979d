"""Chat templates: rendered and tokenized exactly as transformers' ``apply_chat_template`` does (a
Qwen-style template in tokenizer_config.json, a Llama-3-style one in chat_template.jinja, named
templates), ``Engine.chat``, and a sandbox that refuses templates reaching for Python internals."""

import json
import shutil

import jinja2
import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from atom_core.engine.chat_template import ChatTemplateError, render
from atom_core.engine.engine import DEMO_MODEL
from atom_core.engine.tokenizer import Tokenizer

QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- set year = strftime_now("%Y") %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday: " + (date_string if date_string is defined else year) + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] == 'ipython' %}{%- continue %}{%- endif %}
    {%- if (message['role'] == 'user') != (ns.turns % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Zephyr's: no whitespace control of its own, it relies on the environment's trim_blocks / lstrip_blocks.
ZEPHYR_TEMPLATE = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  You answer in French.  "}, {"role": "user", "content": "Où est la gare ? ☕"},
     {"role": "assistant", "content": "Tout droit."}, {"role": "user", "content": "Merci — et après?"}],
    [{"role": "user", "content": "What's 2+2?", "name": None}, {"role": "assistant", "content": " 4 \n"},
     {"role": "ipython", "content": "ignored by llama"}, {"role": "user", "content": "<b>and 3+3</b>"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}]},
     {"role": "tool", "content": '{"temp": 21}'}, {"role": "user", "content": "And tomorrow?"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _tokenizer_folder(folder, config, template_file=None):
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    tok.add_special_tokens(SPECIAL)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    qwen = _tokenizer_folder(root / "qwen", {"chat_template": QWEN_TEMPLATE, "eos_token": "<|im_end|>",
                                             "pad_token": "<|endoftext|>", "bos_token": None})
    llama = _tokenizer_folder(root / "llama", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                               "add_bos_token": True,
                                               "chat_template": "{{ 'the .jinja file replaces me' }}"},
                              template_file=LLAMA3_TEMPLATE)
    return {"qwen": qwen, "llama": llama}


@pytest.mark.parametrize("style", ["qwen", "llama", "zephyr"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_and_tokens_equal_transformers_apply_chat_template(folders, style, generation_prompt):
    from transformers import AutoTokenizer

    folder = folders["qwen" if style == "zephyr" else style]
    ours, theirs = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for i, conversation in enumerate(CONVERSATIONS):
        kwargs = {"tools": TOOLS} if style == "qwen" and i == 3 else {}
        if style == "zephyr":  # a template passed in, not the checkpoint's
            kwargs = {"chat_template": ZEPHYR_TEMPLATE}
        if style == "llama" and i == 3:  # a tool message: this template refuses it, with transformers too
            with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
                theirs.apply_chat_template(conversation, tokenize=False)
            with pytest.raises(ChatTemplateError, match="roles must alternate"):
                ours.apply_chat_template(conversation)
            continue
        text = ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)
        assert text == theirs.apply_chat_template(conversation, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **kwargs)
        token_ids = ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt, **kwargs)
        assert token_ids == theirs.apply_chat_template(conversation, add_generation_prompt=generation_prompt,
                                                       tokenize=True, return_dict=False, **kwargs)
        marker = {"qwen": SPECIAL[0], "llama": SPECIAL[3], "zephyr": "<|im_end|>"}[style]  # a special token in it
        assert text.count(marker) == token_ids.count(ours._tok.token_to_id(marker)) > 0
    if style == "llama":  # template variables: date_string given, and the BOS written once (by the template)
        text = ours.apply_chat_template(CONVERSATIONS[0], tokenize=False, date_string="26 Jul 2024")
        assert "Today: 26 Jul 2024" in text and text.count("<|begin_of_text|>") == 1


@pytest.mark.parametrize("post_processor, config", [
    (True, {"bos_token": "<|begin_of_text|>"}),                          # Llama-3: the post-processor adds BOS
    (True, {"bos_token": "<|begin_of_text|>", "add_bos_token": True}),   # both: one BOS
    (False, {"bos_token": "<|begin_of_text|>", "add_bos_token": True}),  # the config alone: no BOS
    (False, {"bos_token": None}),                                        # no BOS (Qwen)
], ids=["post_processor", "both", "add_bos_token", "none"])
@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "LlamaTokenizerFast"])
def test_plain_text_token_ids_and_the_bos_equal_transformers_encode(tmp_path, post_processor, config, tokenizer_class):
    """The BOS comes from the post-processor alone, in transformers 5 for every class. (transformers' Llama class
    may also split text its own way: some transformers 5 releases replace tokenizer.json's pre-tokenizer, so for
    it only the BOS is compared.)"""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(tmp_path / "tok", {**config, "tokenizer_class": tokenizer_class})
    if post_processor:
        tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([tok.post_processor, processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)])
        ]) if tok.post_processor is not None else processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)])
        tok.save(str(folder / "tokenizer.json"))
    ours, theirs = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for text in ["Return the number of", "<|begin_of_text|>Hello", " leading space"]:
        if tokenizer_class == "PreTrainedTokenizerFast":
            assert ours.encode(text) == theirs.encode(text)
            assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    bos = ours.bos_token_id
    assert (ours.encode("Return")[0] == bos) is (theirs.encode("Return")[0] == bos) is post_processor


def test_named_templates_and_the_template_argument(tmp_path):
    folder = _tokenizer_folder(tmp_path / "named", {"chat_template": [
        {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | length }} tools: {{ messages[-1].content }}"}]})
    tok = Tokenizer(folder)
    conversation = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(conversation, tokenize=False) == "[user]hi"
    assert tok.apply_chat_template(conversation, tools=TOOLS, tokenize=False) == "1 tools: hi"
    assert tok.apply_chat_template(conversation, chat_template="tool_use", tools=[], tokenize=False) == "0 tools: hi"
    assert tok.apply_chat_template(conversation, chat_template="<{{ messages[0].role }}>", tokenize=False) == "<user>"


@pytest.mark.parametrize("template, message", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError: access to attribute '__class__'"),
    ("{{ cycler.__init__.__globals__ }}", "SecurityError"),
    ("{% set x = messages.append({'role': 'x'}) %}", "SecurityError: access to attribute 'append'"),
    ("{{ messages[0].content.__len__() }}", "SecurityError"),
    ("{% set ns = namespace(_private=1) %}", "underscore-prefixed"),
    ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
    ("{% if %}", "does not compile"),
])
def test_templates_are_sandboxed_and_their_errors_are_chat_template_errors(template, message):
    with pytest.raises(ChatTemplateError, match=message):
        render(template, [{"role": "user", "content": "hi"}], add_generation_prompt=True)


@pytest.mark.parametrize("template, variables, message", [
    ("{% set ns = namespace(n=0) %}", {"namespace": 1}, "TypeError"),
    ("{{ raise_exception('bad role') }}", {"raise_exception": 1}, "TypeError"),
    ("{{ 1 // n }}", {"n": 0}, "ZeroDivisionError"),
    ("{{ (n | int) + 1 }}{{ range(n) | list }}", {"n": 10**9}, "OverflowError|range too big"),
])
def test_a_template_failing_on_its_variables_is_a_chat_template_error(template, variables, message):
    with pytest.raises(ChatTemplateError, match=message):
        render(template, [{"role": "user", "content": "hi"}], add_generation_prompt=True, **variables)


def test_a_tokenizer_without_a_template_refuses_by_name():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(DEMO_MODEL).apply_chat_template([{"role": "user", "content": "hi"}])


# A conversation ending with the assistant's partial answer (padded: templates that trim it are cut after the
# trimmed text, as transformers does), and one whose final message is content parts.
OPEN_ENDED = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "  The colour is "}],
    CONVERSATIONS[1][:3],
    [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "Hello, I"}]}],
]


@pytest.mark.parametrize("style", ["qwen", "llama"])
def test_continue_final_message_equals_transformers(folders, style):
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer(folders[style]), AutoTokenizer.from_pretrained(folders[style])
    parts = "{% for m in messages %}{{ m.role }}: {% for p in m.content %}{{ p.text }}{% endfor %}<|im_end|>{% endfor %}"
    for conversation, template in [(OPEN_ENDED[0], {}), (OPEN_ENDED[1], {}), (OPEN_ENDED[2], {"chat_template": parts})]:
        if template and style == "llama":
            continue
        kwargs = dict(add_generation_prompt=False, continue_final_message=True, **template)
        text = ours.apply_chat_template(conversation, tokenize=False, **kwargs)
        assert text == theirs.apply_chat_template(conversation, tokenize=False, **kwargs)
        content = conversation[-1]["content"]
        assert text.rstrip().endswith((content if isinstance(content, str) else content[0]["text"]).strip())
        assert ours.apply_chat_template(conversation, **kwargs) == theirs.apply_chat_template(
            conversation, tokenize=True, return_dict=False, **kwargs)


PARTS = [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
                  "{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}")


def test_text_parts_are_joined_for_a_string_template_and_kept_for_one_that_loops_over_them():
    """vLLM's content formats: a template that never loops over a message's content ("string") gets the text
    parts joined by newlines (transformers would concatenate a list to a string and fail); one that does
    ("openai") gets the parts."""
    from atom_core.engine.chat_template import iterates_content, render

    conversation = [{"role": "user", "content": PARTS}]
    string_template = "{% for m in messages %}[INST] {{ m['content'] + ' [/INST]' }}{% endfor %}"
    assert not iterates_content(string_template) and iterates_content(PARTS_TEMPLATE)
    assert render(string_template, conversation, add_generation_prompt=False) == "[INST] part one\npart two [/INST]"
    assert render(PARTS_TEMPLATE, conversation, add_generation_prompt=False) == "<user>[part one][part two]"
    assert iterates_content("{% for m in messages %}{% for p in m.content | selectattr('type') %}{% endfor %}"
                            "{% endfor %}")
    with pytest.raises(ChatTemplateError, match="only text is supported"):
        render(string_template, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
               add_generation_prompt=False)


def test_continue_final_message_refusals():
    template = "{% for m in messages %}{{ m.role }}: {{ m.content | upper }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        render(template, OPEN_ENDED[0], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not write the final message's content as given"):
        render(template, OPEN_ENDED[0], add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="final message with text content"):  # (a template given the parts)
        render(PARTS_TEMPLATE, [{"role": "assistant", "content": [{"type": "image"}]}], add_generation_prompt=False,
               continue_final_message=True)


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory):
    """The demo model with a plain-text template (its own tokens only: the model has 2048)."""
    folder = tmp_path_factory.mktemp("demo_chat") / "model"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}")
    with ops.use_backend("torch"):
        yield folder, Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)


def test_engine_chat_generates_from_the_rendered_prompt(chat_engine):
    from transformers import AutoTokenizer

    folder, engine = chat_engine
    greedy = SamplingParams(temperature=0, max_tokens=5)
    hf = AutoTokenizer.from_pretrained(folder)
    with ops.use_backend("torch"):
        one = engine.chat(CONVERSATIONS[1], greedy, use_tqdm=False)
        many = engine.chat(CONVERSATIONS[:3], [greedy, SamplingParams(temperature=0, max_tokens=3), greedy],
                           use_tqdm=False)
        plain = engine.generate([hf.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)], greedy, use_tqdm=False)
    assert len(one) == 1 and len(many) == 3 and [len(o.token_ids) for o in many] == [5, 3, 5]
    for conversation, out in zip(CONVERSATIONS[:3], many):
        assert out.prompt_token_ids == hf.apply_chat_template(conversation, add_generation_prompt=True,
                                                              tokenize=True, return_dict=False)
    assert one[0].prompt_token_ids[0] == 0 and one[0].prompt_token_ids.count(0) == 1  # the template's BOS only
    assert one[0].token_ids == plain[0].token_ids and many[1].token_ids == one[0].token_ids[:3]
    with pytest.raises(ChatTemplateError, match="chat template: TemplateError: stop"):
        engine.chat(CONVERSATIONS[0], greedy, chat_template="{{ raise_exception('stop') }}", use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_engine_chat_takes_llm_chat_keywords_and_refuses_others(chat_engine):
    """vLLM's ``LLM.chat`` keywords: ``sampling_params=`` is the parameters (greedy, 3 tokens), template variables
    go in ``chat_template_kwargs``, ``continue_final_message`` leaves the final turn open; any other keyword is
    refused rather than passed to the template."""
    folder, engine = chat_engine
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if shout %}LOUD{% endif %}"
    conversation = [{"role": "user", "content": "Return the"}, {"role": "assistant", "content": "value of"}]
    with ops.use_backend("torch"):
        out = engine.chat(conversation, sampling_params=SamplingParams(temperature=0, max_tokens=3),
                          chat_template=template, add_generation_prompt=False, continue_final_message=True,
                          chat_template_kwargs={"shout": True}, use_tqdm=False)[0]
        again = engine.chat(conversation, SamplingParams(temperature=0, max_tokens=3), chat_template=template,
                            add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and out.token_ids == again.token_ids
    assert out.prompt_token_ids == engine.tokenizer.encode("user: Return the\nassistant: value of",
                                                           add_special_tokens=False)
    shouted = engine.tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=False,
                                                   tokenize=False, shout=True)
    assert shouted.endswith("LOUD")  # chat_template_kwargs reach the template (the open final turn cut it here)
    with pytest.raises(TypeError, match="unexpected keyword argument 'enable_thinking'"):
        engine.chat(conversation, enable_thinking=False, use_tqdm=False)
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        engine.chat(conversation, chat_template_kwargs=["shout"], use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_engine_chat_template_kwargs_take_the_place_of_the_named_arguments_as_in_vllm(chat_engine):
    """vLLM's ``LLM.chat`` updates its named template arguments with ``chat_template_kwargs``: the dict's
    ``add_generation_prompt`` / ``chat_template`` win. Keys chat fills itself are refused by name."""
    folder, engine = chat_engine
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}" \
               "assistant:{% endif %}"
    conversation = [{"role": "user", "content": "Return the"}]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with ops.use_backend("torch"):
        by_dict = engine.chat(conversation, greedy, chat_template="{{ raise_exception('not this one') }}",
                              chat_template_kwargs={"chat_template": template, "add_generation_prompt": False},
                              use_tqdm=False)[0]
        named = engine.chat(conversation, greedy, chat_template=template, add_generation_prompt=False,
                            use_tqdm=False)[0]
    assert by_dict.prompt_token_ids == named.prompt_token_ids == engine.tokenizer.encode(
        "user: Return the\n", add_special_tokens=False)
    assert by_dict.token_ids == named.token_ids
    for key in ("tokenize", "messages", "conversation"):
        with pytest.raises(ChatTemplateError, match=f"chat_template_kwargs: '{key}' cannot be set"):
            engine.chat(conversation, greedy, chat_template=template, chat_template_kwargs={key: True},
                        use_tqdm=False)
    assert not engine.has_unfinished_requests()
