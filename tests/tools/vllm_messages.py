"""Reference rendering of Anthropic Messages requests: vLLM 0.33's own conversion, then HF.

Reads a JSON list of Messages request bodies on stdin and prints, for each, the text the engine
would tokenize and its token ids ({"text", "ids"}), or {"error": "..."} where vLLM rejects it.

    python vllm_messages.py VLLM_SRC TOKENIZER_DIR [CHAT_TEMPLATE_FILE] < requests.json

VLLM_SRC is the directory `make setup` extracts vLLM 0.33's sources into (the files pinned in
tests/tools/setup.sh). What runs is vLLM's code, unchanged:
- `vllm/entrypoints/anthropic/protocol.py`, the request models (pydantic) and their checks;
- the conversion methods of `AnthropicServingMessages` in `vllm/entrypoints/anthropic/serving.py`
  (`to_chat_completion_request` and every `_convert_*`/`_handle_*` helper, and the template probe
  `_detect_merge_inline_system`), lifted out of the class with `ast`, since the class itself
  needs the whole engine;
- `FunctionDefinition` and `ChatCompletionToolsParam`, the tool models whose dump the template
  sees.
Their imports of the rest of vLLM (which needs torch) are stood in for by the few names they
use. The chat request they build is kept as plain attributes. Then, as vLLM's chat path does:
tools dumped from their models, `reasoning_effort` and `enable_thinking` passed as template
kwargs, messages prepared by `hf_tokenize.vllm_message` (vLLM's content flattening, re-written)
and rendered by HF transformers.
"""

import ast
import json
import pathlib
import sys
import types
from typing import Any, get_args

import jinja2
import jinja2.ext
import jinja2.sandbox
import pydantic
from transformers import AutoTokenizer

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from hf_tokenize import vllm_message  # noqa: E402

# The conversion methods of AnthropicServingMessages (all that does not touch the engine).
CONVERSION_METHODS = {
    "_detect_merge_inline_system",
    "_convert_image_source_to_url",
    "to_chat_completion_request",
    "_convert_system_message",
    "_extract_system_text",
    "_convert_messages",
    "_convert_message_content",
    "_convert_block",
    "_convert_tool_use_block",
    "_convert_tool_result_block",
    "_convert_user_tool_result",
    "_build_base_request",
    "_handle_thinking",
    "_handle_output_config",
    "_handle_streaming_options",
    "_convert_tool_choice",
    "_resolve_tools",
    "_convert_tools",
}


def stub_module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


class OpenAIBaseModel(pydantic.BaseModel):
    """vLLM's base of its OpenAI models: extra fields allowed."""

    model_config = pydantic.ConfigDict(extra="allow")


class ChatRequest:
    """The ChatCompletionRequest the conversion builds, as plain attributes (defaults as vLLM's)."""

    def __init__(self, **fields):
        self.tools = None
        self.tool_choice = None
        self.reasoning_effort = None
        self.stream = False
        self.__dict__.update(fields)

    @staticmethod
    def model_validate(value):
        return value


def classes_from(path, names, namespace):
    """Executes the named top-level classes of a vLLM source file in `namespace`."""
    tree = ast.parse(pathlib.Path(path).read_text())
    body = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in names]
    missing = set(names) - {node.name for node in body}
    if missing:
        sys.exit(f"{path} has no {sorted(missing)}")
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)


def load_vllm(src):
    src = pathlib.Path(src)
    # What the request models import from the rest of vLLM.
    stub_module("vllm")
    stub_module("vllm.envs", VLLM_MAX_STOP_STRINGS=None)
    stub_module(
        "vllm.entrypoints.generate.base.protocol",
        MMPayload=dict[str, Any] | None,
        resolve_return_mm_kwargs_alias=lambda data: data,
    )
    protocol = types.ModuleType("vllm.entrypoints.anthropic.protocol")
    sys.modules[protocol.__name__] = protocol
    exec(compile((src / "vllm/entrypoints/anthropic/protocol.py").read_text(), "anthropic/protocol.py", "exec"),
         protocol.__dict__)

    tools = {"Any": Any, "Literal": __import__("typing").Literal, "OpenAIBaseModel": OpenAIBaseModel,
             "model_serializer": pydantic.model_serializer, "model_validator": pydantic.model_validator,
             "Field": pydantic.Field}
    classes_from(src / "vllm/entrypoints/generate/base/protocol.py", {"FunctionDefinition"}, tools)
    classes_from(src / "vllm/entrypoints/openai/chat_completion/protocol.py", {"ChatCompletionToolsParam"}, tools)

    namespace = dict(protocol.__dict__)
    namespace.update(
        json=json, time=__import__("time"), jinja2=jinja2, get_args=get_args,
        ChatCompletionRequest=ChatRequest, ChatCompletionToolsParam=tools["ChatCompletionToolsParam"],
        # Only structured-output and named-tool-choice requests reach these; they do not render.
        ResponseFormat=dict, JsonSchemaResponseFormat=dict, StreamOptions=ChatRequest,
        ChatCompletionNamedToolChoiceParam=ChatRequest,
    )
    tree = ast.parse((src / "vllm/entrypoints/anthropic/serving.py").read_text())
    (serving,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AnthropicServingMessages"]
    methods = [n for n in serving.body if isinstance(n, ast.FunctionDef) and n.name in CONVERSION_METHODS]
    missing = CONVERSION_METHODS - {m.name for m in methods}
    if missing:
        sys.exit(f"serving.py has no {sorted(missing)}")
    serving.bases, serving.keywords, serving.body = [], [], methods
    exec(compile(ast.Module(body=[serving], type_ignores=[]), "anthropic/serving.py", "exec"), namespace)
    return protocol, namespace["AnthropicServingMessages"]


def disabled_thinking_effort(tokenizer, protocol):
    """vLLM's DisabledThinkingEffortResolver probe: "low" where "none" renders like an effort."""
    def render(effort):
        try:
            return tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                 add_generation_prompt=True, reasoning_effort=effort,
                                                 enable_thinking=effort != "none")
        except Exception:
            return None

    none = render("none")
    if none is None or any(render(effort) == none for effort in get_args(protocol.AnthropicEffort)):
        return "low"
    return "none"


def main():
    protocol, serving = load_vllm(sys.argv[1])
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
    if len(sys.argv) > 3:
        tokenizer.chat_template = pathlib.Path(sys.argv[3]).read_text()
    merge = serving._detect_merge_inline_system(tokenizer.chat_template)
    disabled_effort = disabled_thinking_effort(tokenizer, protocol)
    out = []
    for body in json.load(sys.stdin):
        try:
            request = protocol.AnthropicMessagesRequest.model_validate(body)
            chat = serving.to_chat_completion_request(
                request, merge_inline_system=merge, disabled_thinking_effort=disabled_effort
            )
        except (pydantic.ValidationError, ValueError) as e:
            out.append({"error": str(e)})
            continue
        kwargs = dict(chat.chat_template_kwargs or {})
        if chat.reasoning_effort is not None:
            kwargs["reasoning_effort"] = chat.reasoning_effort
            kwargs.setdefault("enable_thinking", chat.reasoning_effort != "none")
        text = tokenizer.apply_chat_template(
            [vllm_message(m) for m in chat.messages],
            tools=None if chat.tools is None else [tool.model_dump() for tool in chat.tools],
            add_generation_prompt=True,
            tokenize=False,
            **kwargs,
        )
        out.append({"text": text, "ids": tokenizer(text, add_special_tokens=False)["input_ids"],
                    "merge_inline_system": merge, "disabled_thinking_effort": disabled_effort})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
