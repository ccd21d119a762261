"""Reference tokenization: HF transformers, with vLLM's request handling in front of it.

Reads a JSON list of cases on stdin, prints a JSON list of {"text", "ids"} on stdout.

    {"kind": "prompt", "text": "...", "add_special_tokens": true}
    {"kind": "chat", "messages": [...], "tools": [...]?, "add_generation_prompt": true,
     "continue_final_message": false, "chat_template_kwargs": {...}?}

Chat messages are prepared as vLLM prepares them for templates that take string content
(Qwen3's): content parts are joined with "\\n", null content becomes "", and tool-call
arguments given as JSON strings are parsed (empty ones become {}), and an assistant's
`reasoning` is also given as `reasoning_content`. The rendered text is then
encoded without adding special tokens, as vLLM's chat endpoint does.

    python hf_tokenize.py TOKENIZER_DIR < cases.json
"""

import json
import sys

from transformers import AutoTokenizer


def vllm_message(message):
    message = dict(message)
    content = message.get("content")
    if content is None:
        message["content"] = ""
    elif isinstance(content, list):
        message["content"] = "\n".join(
            part if isinstance(part, str) else part["text"] for part in content
        )
    if message.get("role") == "assistant" and message.get("reasoning") is not None:
        # vLLM's chat parser hands templates the reasoning under both names.
        message["reasoning_content"] = message["reasoning"]
    for call in message.get("tool_calls") or []:
        function = call["function"]
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            function["arguments"] = json.loads(arguments)
    return message


def main():
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    out = []
    for case in json.load(sys.stdin):
        if case["kind"] == "prompt":
            ids = tokenizer(case["text"], add_special_tokens=case.get("add_special_tokens", True))["input_ids"]
            out.append({"text": case["text"], "ids": ids})
            continue
        text = tokenizer.apply_chat_template(
            [vllm_message(m) for m in case["messages"]],
            tools=case.get("tools"),
            add_generation_prompt=case.get("add_generation_prompt", True),
            continue_final_message=case.get("continue_final_message", False),
            tokenize=False,
            **(case.get("chat_template_kwargs") or {}),
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append({"text": text, "ids": ids})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
