"""Reference rendering of Anthropic Messages and OpenAI Responses requests: vLLM 0.33's own
request models and conversion code, then HF transformers.

Reads a JSON list of request bodies on stdin and prints, for each, the text the engine would
tokenize and its token ids ({"text", "ids"}), or {"error": "..."} where vLLM rejects it.

    python vllm_render.py {messages|responses} VLLM_SRC TOKENIZER_DIR [CHAT_TEMPLATE_FILE] < requests.json

VLLM_SRC is the directory `make setup` extracts vLLM 0.33's sources into (the files pinned in
tests/tools/setup.sh). Those modules run unchanged: the request models with their validators
(`vllm/entrypoints/anthropic/protocol.py`, `vllm/entrypoints/openai/responses/protocol.py`),
the conversions (`AnthropicServingMessages.to_chat_completion_request` and its template probe in
`anthropic/serving.py`, building a real `ChatCompletionRequest`; `construct_input_messages` and `construct_tool_dicts` in
`responses/utils.py`, with `tool_parsers/utils.py`), the tool models whose dump the template sees
(`generate/base/protocol.py`, `openai/chat_completion/protocol.py`) and the template kwargs
(`renderers/params.py`, both requests' `build_chat_params`). Every other `vllm.*` import (the
engine, torch) is stood in for by a stub module; the few names the conversion calls get small
stand-ins below. Then, as vLLM's chat path does: messages prepared by `hf_tokenize.vllm_message`
(vLLM's content flattening, re-written) and rendered by HF transformers with the tools dumped
and the kwargs merged.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import pathlib
import sys
import types
import uuid
from typing import Any, get_args

import jinja2.ext
import jinja2.sandbox  # noqa: F401  (vLLM's template probe reaches for it)
import pydantic
from transformers import AutoTokenizer

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from hf_tokenize import vllm_message  # noqa: E402

# The vLLM modules that run as shipped.
REAL = {
    "vllm.entrypoints.anthropic.protocol",
    "vllm.entrypoints.anthropic.serving",
    "vllm.entrypoints.generate.base.protocol",
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.openai.responses.protocol",
    "vllm.entrypoints.openai.responses.utils",
    "vllm.tool_parsers.utils",
    "vllm.renderers.params",
}
# Imports stood in for: the rest of vLLM, and packages only its engine paths use.
STUBBED = ("vllm", "openai_harmony", "partial_json_parser", "fastapi")


class OpenAIBaseModel(pydantic.BaseModel):
    """vLLM's base of its OpenAI models: extra fields allowed."""

    model_config = pydantic.ConfigDict(extra="allow")


class VLLMValidationError(ValueError):
    def __init__(self, message, *args, **kwargs):
        super().__init__(message)


class Fields:
    """A stand-in for vLLM's parameter holders (`ChatParams`): their fields as attributes."""

    def __init__(self, *args, **fields):
        self.__dict__.update(fields)


# What a stubbed import gives for these names (anything else: typing.Any).
NAMES = {
    "OpenAIBaseModel": OpenAIBaseModel,
    "VLLMValidationError": VLLMValidationError,
    "init_logger": logging.getLogger,
    "random_uuid": lambda: uuid.uuid4().hex,
    "resolve_return_mm_kwargs_alias": lambda data: data,
    "validate_cache_salt": lambda salt: None,
    "LazyLoader": lambda *args: None,
    "ChatParams": Fields,
    "TokenizeParams": Fields,
    "OpenAIServingChat": object,
    "VLLM_MAX_STOP_STRINGS": None,
}


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return NAMES.get(name, Any)


class VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, src):
        self.src = src

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in STUBBED:
            return None
        if name in REAL:
            return importlib.util.spec_from_file_location(name, self.src / (name.replace(".", "/") + ".py"))
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def load_vllm(src):
    sys.meta_path.insert(0, VllmFinder(pathlib.Path(src)))
    import vllm.renderers.params as params

    NAMES["merge_kwargs"] = params.merge_kwargs
    NAMES["map_reasoning_effort"] = params.map_reasoning_effort
    import vllm.entrypoints.anthropic.protocol as anthropic
    import vllm.entrypoints.anthropic.serving as anthropic_serving
    import vllm.entrypoints.openai.responses.protocol as responses
    import vllm.entrypoints.openai.responses.utils as responses_utils

    return anthropic, anthropic_serving.AnthropicServingMessages, responses, responses_utils


def disabled_thinking_effort(tokenizer, efforts):
    """vLLM's DisabledThinkingEffortResolver probe: "low" where "none" renders like an effort."""

    def render(effort):
        try:
            return tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                 add_generation_prompt=True, reasoning_effort=effort,
                                                 enable_thinking=effort != "none")
        except Exception:
            return None

    none = render("none")
    return "low" if none is None or any(render(e) == none for e in efforts) else "none"


def messages_chat(body, anthropic, serving, tokenizer):
    """An Anthropic Messages request as vLLM renders it: (messages, tools, kwargs, extra)."""
    merge = serving._detect_merge_inline_system(tokenizer.chat_template)
    disabled = disabled_thinking_effort(tokenizer, get_args(anthropic.AnthropicEffort))
    request = anthropic.AnthropicMessagesRequest.model_validate(body)
    chat = serving.to_chat_completion_request(request, merge_inline_system=merge,
                                              disabled_thinking_effort=disabled)
    kwargs = chat.build_chat_params(None, "auto").chat_template_kwargs
    tools = None if chat.tools is None else [tool.model_dump() for tool in chat.tools]
    return chat.messages, tools, kwargs, {"merge_inline_system": merge, "disabled_thinking_effort": disabled}


def responses_chat(body, responses, utils):
    """A Responses request as vLLM renders it (no stored history: none is given)."""
    request = responses.ResponsesRequest.model_validate(body)
    messages = utils.construct_input_messages(request_instructions=request.instructions,
                                              request_input=request.input)
    tools = utils.construct_tool_dicts(request.tools, request.tool_choice)
    kwargs = request.build_chat_params(None, "auto").chat_template_kwargs
    return messages, tools, kwargs, {}


def main():
    api, src, tokenizer_dir = sys.argv[1:4]
    anthropic, serving, responses, utils = load_vllm(src)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(sys.argv) > 4:
        tokenizer.chat_template = pathlib.Path(sys.argv[4]).read_text()
    out = []
    for body in json.load(sys.stdin):
        try:
            if api == "messages":
                messages, tools, kwargs, extra = messages_chat(body, anthropic, serving, tokenizer)
            else:
                messages, tools, kwargs, extra = responses_chat(body, responses, utils)
        except (pydantic.ValidationError, ValueError) as e:
            out.append({"error": str(e)})
            continue
        text = tokenizer.apply_chat_template([vllm_message(m) for m in messages], tools=tools, tokenize=False,
                                             **kwargs)
        out.append({"text": text, "ids": tokenizer(text, add_special_tokens=False)["input_ids"], **extra})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
