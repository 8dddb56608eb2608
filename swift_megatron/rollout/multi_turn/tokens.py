"""Scheduler messages -> the token ids appended after a model turn (token-in, token-out).

The model's tokens are never re-encoded: the conversation grows by appending, after the tokens
the engine produced, the tokens the chat template puts between that assistant turn and the next
one. They are found by rendering a fixed stand-in conversation with and without the new messages
and keeping the difference, starting right after the end-of-turn token that closes the stand-in
assistant message (the model's own completion ended with that token):

    <|im_start|>assistant\nx<|im_end|>  +  \n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n
    (model tokens, loss)                  (environment tokens, no loss)

When the model's last token is not the template's end of turn (an EOS the template does not
use), the template's whole closing text is appended instead.

With a template that renders earlier turns differently (e.g. drops their reasoning), the
history the model sees is still exactly what it generated.
"""
from typing import Any, Dict, List, Optional, Sequence

from swift_megatron.errors import UserError

_STAND_IN = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def render(tokenizer: Any, messages: Sequence[Dict[str, Any]], *, generation_prompt: bool,
           template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    import jinja2

    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=generation_prompt,
                                             **(template_kwargs or {}))
    except jinja2.TemplateError as error:
        roles = ", ".join(str(m.get("role")) for m in messages)
        raise UserError(f"multi-turn: the chat template rejected the messages (roles {roles}): "
                        f"{error}") from None


def prompt_ids(tokenizer: Any, messages: Sequence[Dict[str, Any]],
               template_kwargs: Optional[Dict[str, Any]] = None) -> List[int]:
    """The first prompt of an episode whose scheduler set its own messages (as data/prompts.py
    renders dataset prompts)."""
    text = render(tokenizer, messages, generation_prompt=True, template_kwargs=template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def turn_text(tokenizer: Any, messages: Sequence[Dict[str, Any]], end_of_turn: str,
              template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """The text between an assistant turn that ended with `end_of_turn` (its last token's text)
    and the model's next turn, with `messages` in between (module docstring)."""
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise UserError(f"multi-turn: a scheduler message must be a dict with string 'role' "
                            f"and 'content', got {message!r}")
    before = render(tokenizer, _STAND_IN, generation_prompt=False, template_kwargs=template_kwargs)
    after = render(tokenizer, _STAND_IN + list(messages), generation_prompt=True,
                   template_kwargs=template_kwargs)
    if not after.startswith(before):
        raise UserError("multi-turn: the chat template renders earlier turns differently once "
                        "messages follow them; messages cannot be appended token by token")
    answer_end = before.rfind(_STAND_IN[-1]["content"]) + len(_STAND_IN[-1]["content"])
    closing = before.find(end_of_turn, answer_end) if end_of_turn else -1
    start = closing + len(end_of_turn) if closing >= 0 else answer_end
    return after[start:]


def turn_ids(tokenizer: Any, messages: Sequence[Dict[str, Any]], end_of_turn: str,
             template_kwargs: Optional[Dict[str, Any]] = None) -> List[int]:
    """turn_text as token ids (no special tokens added)."""
    text = turn_text(tokenizer, messages, end_of_turn, template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
