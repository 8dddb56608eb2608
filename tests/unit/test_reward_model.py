"""--reward_model: a sequence-classification reward model scores chats (batched and padded as
one at a time), --reward_model_plugin classes get the model and rows, names and errors."""
import pytest
import torch

from swift_megatron.errors import UserError
from swift_megatron.rewards import compute_rewards
from swift_megatron.rewards.reward_model import chat_text, reward_model_funcs
from tests.helpers import build_tiny_reward_model

CHATS = [[{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
         [{"role": "user", "content": "Name a colour."},
          {"role": "assistant", "content": "The sky is blue, mostly, on clear days."}]]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "tiny_rm"))


def test_scores_are_logit_zero_of_each_chat(rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    [(name, scorer)] = reward_model_funcs([rm_dir], [], torch.device("cpu"))
    assert name == "tiny_rm"
    [scores] = compute_rewards([(name, scorer)], ["4", "blue"], messages=CHATS)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    for chat, score in zip(CHATS, scores):  # one at a time, no padding
        ids = tokenizer(chat_text(chat, tokenizer), return_tensors="pt")
        with torch.no_grad():
            expected = model(**ids).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-5)
    assert scores[0] != scores[1]
    assert chat_text(CHATS[0], tokenizer) == tokenizer.apply_chat_template(CHATS[0], tokenize=False)


def test_plugin_class_gets_model_tokenizer_and_rows(rm_dir):
    from swift_megatron.rollout.plugin_registry import RM_PLUGINS

    class LengthJudge:
        def __init__(self, model, tokenizer):
            self.vocab = len(tokenizer)
            assert isinstance(model, torch.nn.Module)

        def __call__(self, inputs, **kwargs):
            return torch.tensor([len(row["messages"][-1]["content"]) + row["solution"]
                                 for row in inputs], dtype=torch.float32)

    RM_PLUGINS.register("length_judge", LengthJudge, "test")
    funcs = reward_model_funcs([rm_dir, rm_dir], ["length_judge", "default"], torch.device("cpu"))
    assert [name for name, _ in funcs] == ["tiny_rm", "tiny_rm_1"]
    scores = compute_rewards(funcs[:1], ["4", "blue"], messages=CHATS, solution=[10, 20])
    assert scores == [[1.0 + 10, 39.0 + 20]]
    with pytest.raises(UserError, match="unknown reward-model plugin 'nope'"):
        reward_model_funcs([rm_dir], ["nope"], torch.device("cpu"))


def test_generative_reward_model_loads_as_causal_lm_for_a_plugin(tiny_model_dir):
    from swift_megatron.rollout.plugin_registry import RM_PLUGINS

    class Judge:
        def __init__(self, model, tokenizer):
            self.kind = type(model).__name__

        def __call__(self, inputs, **kwargs):
            return [1.0 if self.kind == "Qwen3ForCausalLM" else 0.0] * len(inputs)

    RM_PLUGINS.register("judge", Judge, "test")
    [(_, scorer)] = reward_model_funcs([tiny_model_dir("qwen3")], ["judge"], torch.device("cpu"))
    assert compute_rewards([scorer], ["4", "blue"], messages=CHATS) == [[1.0, 1.0]]
    with pytest.raises(UserError, match="needs a --reward_model_plugin"):
        reward_model_funcs([tiny_model_dir("qwen3")], [], torch.device("cpu"))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="--reward_model .*: not a reward model"):
        reward_model_funcs([str(tmp_path)], [], torch.device("cpu"))


@pytest.mark.parametrize("flag, expected", [(None, "sdpa"), ("eager", "eager")])
def test_attn_impl_chooses_transformers_attention(rm_dir, tiny_model_dir, flag, expected):
    """--attn_impl reaches the models transformers runs: reward models and the embedded
    rollout engine (ms-swift's flash_attn is transformers' flash_attention_2)."""
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.rewards.reward_model import load_reward_model
    from swift_megatron.rollout.hf import HFEngine

    argv = ["--model", "m", "--dataset", "d"] + (["--attn_impl", flag] if flag else [])
    chosen = parse_command(RlhfArguments, argv, "x").model.attn_implementation
    model, _ = load_reward_model(rm_dir, torch.device("cpu"), attn_implementation=chosen)
    engine = HFEngine(tiny_model_dir("qwen3"), torch.device("cpu"), torch.float32, [2], 0,
                      attn_implementation=chosen)
    assert model.config._attn_implementation == engine.model.config._attn_implementation == expected
    assert parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", "--attn_impl",
                                         "flash_attn"], "x").model.attn_implementation == \
        "flash_attention_2"
