"""The rollout server's request schemas and checks (rollout/server.py serves them): pydantic
models with strict types (a number given as a string is no number) and valid Unicode text (a lone
surrogate, valid JSON, is refused by its field with a 422), then the checks the schema cannot
express (400: seeds per prompt, empty prompts, token ids outside the vocabulary, undecodable
images, a bucket's lengths). FastAPI and pydantic come with vLLM and are imported on use.
"""
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

INT32_MAX = 2 ** 31 - 1   # vLLM's token counts are int32


def text_problem(value: Any, where: str = "") -> Optional[str]:
    """Where `value` (a string, or lists and dicts of them, keys included) holds a lone surrogate
    (JSON's "\\ud800", which no UTF-8 tokenizer can take), and which; None when it holds none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"{where or 'the text'} holds a lone surrogate, {ascii(value[exc.start])}, "
                    f"at character {exc.start}: not valid Unicode text")
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, item in items:
        problem = text_problem(key, f"{where}key {ascii(key)}") or \
            text_problem(item, f"{where}[{ascii(key)}]")
        if problem:
            return problem
    return None


def valid_text(value: Any) -> Any:
    """A pydantic after-validator: ValueError (a 422 naming the field) for a lone surrogate."""
    problem = text_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def request_models():
    """The request schemas (pydantic, imported with FastAPI). Numbers are strict: "0.5" (a
    string) is no temperature; text must be valid Unicode (valid_text)."""
    from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt,
                          StrictStr)

    from swift_megatron.rollout.weight_sync import DTYPES

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    Seed = Annotated[StrictInt, Field(ge=0, lt=2 ** 63)]   # vLLM's seeds are int64
    Text = Annotated[StrictStr, AfterValidator(valid_text)]

    def number(default: float, **bounds):
        return Field(default, allow_inf_nan=False, strict=True, **bounds)

    class GenerateRequest(Strict):
        prompts: Union[List[List[StrictInt]], List[Text]] = Field(min_length=1)
        seeds: Optional[List[Optional[Seed]]] = None
        max_tokens: StrictInt = Field(16, ge=1, le=INT32_MAX)
        temperature: float = number(1.0, ge=0)
        top_p: float = number(1.0, gt=0, le=1)
        top_k: StrictInt = Field(-1, ge=-1, le=INT32_MAX)
        repetition_penalty: float = number(1.0, gt=0)
        stop_token_ids: List[Annotated[StrictInt, Field(ge=0)]] = []
        logprobs: StrictBool = True
        images: Optional[List[Optional[List[StrictStr]]]] = None   # base64 image files
        return_routed_experts: StrictBool = False   # each completion's routed experts

    class InitCommunicatorRequest(Strict):
        port: Optional[StrictInt] = Field(None, gt=0, lt=65536)

    class UpdateWeightsRequest(Strict):
        token: StrictStr                 # from /init_communicator
        names: List[StrictStr] = Field(min_length=1)
        dtypes: List[Literal[tuple(DTYPES)]]
        shapes: List[List[Annotated[StrictInt, Field(ge=0)]]]
        last: StrictBool = False

    class CloseCommunicatorRequest(Strict):
        token: Optional[StrictStr] = None

    class TokenRequest(Strict):
        token: StrictStr                 # from /init_communicator

    Texts = Annotated[Dict[str, Any], AfterValidator(valid_text)]   # every string in it

    class RolloutRequest(GenerateRequest):
        prompts: List[List[StrictInt]] = Field(min_length=1)
        messages: List[List[Texts]]
        columns: Optional[List[Texts]] = None
        row_ids: Optional[List[StrictInt]] = None
        max_length: StrictInt = Field(ge=2, le=INT32_MAX)
        limit_scope: Literal["per_round", "total"] = "per_round"
        template_kwargs: Texts = {}

    return (GenerateRequest, InitCommunicatorRequest, UpdateWeightsRequest,
            CloseCommunicatorRequest, RolloutRequest, TokenRequest)


def check_generate(request, vocab_size: int) -> None:
    """400 for values the schema cannot express: seeds count, empty prompts, token ids."""
    from fastapi import HTTPException

    if request.seeds is not None and len(request.seeds) != len(request.prompts):
        raise HTTPException(400, f"seeds: {len(request.seeds)} given for "
                                 f"{len(request.prompts)} prompts")
    for index, prompt in enumerate(request.prompts):
        if len(prompt) == 0:
            raise HTTPException(400, f"prompts[{index}] is empty")
        if not isinstance(prompt, str):
            bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise HTTPException(400, f"prompts[{index}]: token id {bad} is outside the "
                                         f"vocabulary [0, {vocab_size})")
    bad = next((t for t in request.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise HTTPException(400, f"stop_token_ids: {bad} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    if request.images is not None and len(request.images) != len(request.prompts):
        raise HTTPException(400, f"images: {len(request.images)} given for "
                                 f"{len(request.prompts)} prompts")


def decode_images(request) -> Optional[List[Optional[list]]]:
    """The request's images as PIL images; 400 naming the first one that does not decode."""
    import base64

    from fastapi import HTTPException

    from swift_megatron.data.images import load_image
    from swift_megatron.data.prompts import RowError

    if request.images is None:
        return None
    decoded = []
    for index, pictures in enumerate(request.images):
        try:
            decoded.append(None if not pictures else
                           [load_image(base64.b64decode(p, validate=True)) for p in pictures])
        except (ValueError, RowError) as exc:   # binascii.Error; ValueError: not ASCII
            raise HTTPException(400, f"images[{index}]: {exc}") from None
    return decoded


def check_bucket(request) -> None:
    from fastapi import HTTPException

    if not len(request.names) == len(request.dtypes) == len(request.shapes):
        raise HTTPException(400, "names, dtypes and shapes differ in length "
                                 f"({len(request.names)}, {len(request.dtypes)}, "
                                 f"{len(request.shapes)})")
