"""The data classes of ms-swift's `swift.infer_engine.protocol` that plugin code builds or reads:
requests, responses and rollout outputs of gym envs and multi-turn schedulers.

Plain dataclasses with ms-swift's field names and defaults (the fields plugin code uses; the
serving-only ones are left out). They carry data only: nothing here talks to an engine.
"""
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

Messages = List[Dict[str, Any]]  # [{"role": ..., "content": ...}, ...], as swift.template.Messages


@dataclass
class InferRequest:
    """One conversation to answer, with its multimodal inputs and tools."""

    messages: Messages
    images: List[Any] = field(default_factory=list)
    audios: List[str] = field(default_factory=list)
    videos: List[str] = field(default_factory=list)
    tools: Optional[List[Any]] = None
    objects: Dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutInferRequest(InferRequest):
    """A rollout request: `data_dict` holds the dataset row (gym envs read their task from it)."""

    images: List[str] = field(default_factory=list)
    data_dict: Dict[str, Any] = field(default_factory=dict)
    uuid: Optional[str] = None


@dataclass
class RequestConfig:
    """Sampling settings of one request (None: the engine's default)."""

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[List[str]] = field(default_factory=list)
    seed: Optional[int] = None
    stream: bool = False
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    n: int = 1
    return_details: bool = False


@dataclass
class UsageInfo:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass
class ChatMessage:
    role: str
    content: Any
    tool_calls: Optional[List[Any]] = None
    reasoning_content: Optional[str] = None


@dataclass
class ChatCompletionResponseChoice:
    """One generated answer: `finish_reason` is "stop" or "length"; `token_ids` its tokens."""

    index: int
    message: ChatMessage
    finish_reason: Optional[str]
    logprobs: Optional[Dict[str, List[Dict[str, Any]]]] = None
    token_ids: Optional[List[int]] = None


@dataclass
class ChatCompletionResponse:
    model: str
    choices: List[ChatCompletionResponseChoice]
    usage: UsageInfo = field(default_factory=UsageInfo)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: str = "chat.completion"
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_token_ids: Optional[List[int]] = None


@dataclass
class RolloutOutput:
    """What a multi-turn scheduler returns for one trajectory: the final response, the whole
    conversation (`messages`, ending with the last assistant turn), and per turn the response
    token ids, loss masks and logprobs; `rollout_infos` is JSON-serialisable metadata."""

    response: ChatCompletionResponse
    messages: Optional[Messages] = None
    response_token_ids: List[List[int]] = field(default_factory=list)
    response_loss_mask: List[List[int]] = field(default_factory=list)
    rollout_infos: Dict[str, Any] = field(default_factory=dict)
    rollout_logprobs: List[List[float]] = field(default_factory=list)
