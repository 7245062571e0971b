"""Chat templates: how conversational rows (lists of {"role", "content"} messages) become the text of a prompt and
its responses, rendered with the tokenizer's chat template as TRL renders them (ChatTemplate), with the keyword
arguments of every call (the run's chat_template_kwargs, a row's `tools` and `chat_template_kwargs` columns) checked
first. A row of strings renders with no template, so these columns are refused there (refuse_template_columns)."""

import json
import os
from dataclasses import dataclass
from typing import Any

# apply_chat_template's arguments that the rendering sets itself, which chat_template_kwargs may not set
RENDERING_ARGUMENTS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message")


def template_kwargs_problem(kwargs: dict) -> str | None:
    """Why these keyword arguments cannot go to every apply_chat_template call, or None."""
    taken = [key for key in kwargs if key in RENDERING_ARGUMENTS]
    if taken:
        return (
            f"sets {', '.join(taken)}, which the rendering sets itself (the prompt alone with the generation prompt, "
            "prompt and response together without)"
        )
    return None


def tool_list(tools: Any) -> list | None:
    """A row's tools as the chat template takes them: a list of tool schemas (JSON objects; callables from Python),
    given as such or as a JSON string of one; None for none, an empty list included (as TRL: a template may render
    tool boilerplate for an empty list)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(f"tools is a string but not JSON ({error.msg} at character {error.pos})") from None
    expected = "expected a list of tool schemas (JSON objects), or a JSON string of one"
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools is a {type(tools).__name__}, {expected}")
    for tool in tools or []:
        if not isinstance(tool, dict) and not callable(tool):
            raise ValueError(f"tools holds a {type(tool).__name__}, {expected}")
    return tools or None


def refuse_template_columns(row: dict) -> None:
    """A row of strings renders with no chat template, so its tools or chat_template_kwargs would be dropped
    silently: a ValueError instead."""
    for column, given in (
        ("tools", tool_list(row.get("tools"))),
        ("chat_template_kwargs", row.get("chat_template_kwargs")),
    ):
        if given:
            raise ValueError(
                f"the row has {column}, but its texts are strings, which no chat template renders: give its prompt "
                "and responses as lists of messages"
            )


@dataclass(frozen=True)
class ChatTemplate:
    """How conversational rows become text: the tokenizer's chat template, called as TRL 1.16 calls it (DPOTrainer's
    and KTOTrainer's tokenization, trl.data_utils.apply_chat_template), with the same keyword arguments on every
    call for a row: the run's chat_template_kwargs, overridden by the row's `tools` column, then by its own
    `chat_template_kwargs` column (TRL's order for the row's two)."""

    tokenizer: Any
    run_kwargs: dict  # the run's chat_template_kwargs

    def row_kwargs(self, row: dict) -> dict:
        """The keyword arguments of every apply_chat_template call for `row` (ValueError where they are malformed)."""
        own = row.get("chat_template_kwargs")
        if own is not None and not isinstance(own, dict):
            raise ValueError(
                f"chat_template_kwargs is a {type(own).__name__}, expected an object of keyword arguments for the "
                'chat template, e.g. {"enable_thinking": false}'
            )
        tools = {} if row.get("tools") is None else {"tools": row["tools"]}
        kwargs = {**self.run_kwargs, **tools, **(own or {})}
        problem = template_kwargs_problem(kwargs)
        if problem:
            raise ValueError(f"chat_template_kwargs {problem}")
        if "tools" in kwargs:
            kwargs["tools"] = tool_list(kwargs["tools"])
        return kwargs

    def render(self, row: dict, prompt: list[dict], responses: list[list[dict]]) -> tuple[str, list[str], bool]:
        """(prompt text, each response's text, whether tools were rendered) of a row's prompt messages and responses
        (each a list of messages following the prompt). The prompt is rendered with the generation prompt, and each
        response after it, whole; the prompt's text is what all of these share at their start (a template may end
        the generation prompt otherwise than the assistant turn that follows it: DeepSeek-R1, Gemma), each
        response's text the rest of its rendering, its end-of-turn markup included."""
        kwargs = self.row_kwargs(row)
        alone = self.apply(prompt, kwargs, add_generation_prompt=True)
        if kwargs.get("tools") and alone == self.apply(prompt, {**kwargs, "tools": None}, add_generation_prompt=True):
            raise ValueError(
                "the row has tools, but the tokenizer's chat template does not render them (the prompt reads the "
                "same without them): use a tokenizer whose chat template renders tools (model.tokenizer_name_or_path)"
            )
        whole = [self.apply(prompt + response, kwargs) for response in responses]
        shared = os.path.commonprefix([alone, *whole])
        return shared, [text[len(shared) :] for text in whole], bool(kwargs.get("tools"))

    def apply(self, messages: list[dict], kwargs: dict, add_generation_prompt: bool = False) -> str:
        if self.tokenizer.chat_template is None and "chat_template" not in kwargs:
            raise ValueError("conversational rows need a tokenizer with a chat template, and this one has none")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
