"""Scheduler messages -> the token ids appended after a model turn (token-in, token-out).

The model's tokens are never re-encoded: the conversation grows by appending, after the tokens
the engine produced, the tokens the chat template puts between that assistant turn and the next
one. They are found by rendering a stand-in conversation (a user message, an assistant answer)
followed by the new messages and the generation prompt, and keeping the text right after the
end-of-turn token that closes the stand-in answer (the model's own completion ended with that
token):

    <|im_start|>assistant\nx<|im_end|>  +  \n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n
    (model tokens, loss)                  (environment tokens, no loss)

When the turn did not end with the template's end of turn (it was cut at the length limit, or
its EOS is one the template does not use), the template's whole closing text is appended.

How the template renders the answer itself does not matter (Qwen3's, for example, shows the
reasoning block only on the last turn), and the history the model sees is still exactly what it
generated.
"""
from typing import Any, Dict, List, Optional, Sequence

from swift_megatron.errors import UserError

_ANSWER = "swift-megatron-answer-7Qz"   # the stand-in assistant message, unique in the text
_STAND_IN = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ANSWER}]


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


def turn_text(tokenizer: Any, messages: Sequence[Dict[str, Any]], end_of_turn: Optional[str],
              template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """The text between an assistant turn and the model's next turn, with `messages` in between
    (module docstring). `end_of_turn`: the text of the turn's last token when the turn ended
    with an end-of-sequence token (None when it was cut): the template's closing of the answer
    is kept only after it."""
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise UserError(f"multi-turn: a scheduler message must be a dict with string 'role' "
                            f"and 'content', got {message!r}")
    text = render(tokenizer, _STAND_IN + list(messages), generation_prompt=True,
                  template_kwargs=template_kwargs)
    answer = text.find(_ANSWER)
    if answer < 0:
        raise UserError("multi-turn: the chat template drops the assistant's earlier turns once "
                        "messages follow them; messages cannot be appended token by token")
    start = answer + len(_ANSWER)
    if end_of_turn:   # look for it in the template's closing of the answer only
        alone = render(tokenizer, _STAND_IN, generation_prompt=False,
                       template_kwargs=template_kwargs)
        closing = alone[alone.rfind(_ANSWER) + len(_ANSWER):]
        found = text.find(end_of_turn, start, start + len(closing))
        if found >= 0:
            start = found + len(end_of_turn)
    return text[start:]


def turn_ids(tokenizer: Any, messages: Sequence[Dict[str, Any]], end_of_turn: Optional[str],
             template_kwargs: Optional[Dict[str, Any]] = None) -> List[int]:
    """turn_text as token ids (no special tokens added)."""
    text = turn_text(tokenizer, messages, end_of_turn, template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
