"""Which machines' Gated DeltaNet kernels can train (platform/kernels.py): flash-linear-attention
0.6 refuses its gated backward on Hopper with Triton >= 3.4.0, < 3.7.1 unless tilelang is
installed (seen on an H200 with torch 2.11's Triton 3.6.0); the preflight says so before
anything is built, naming the fix."""
import pytest

from swift_megatron.platform import kernels

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("text, parsed", [("3.6.0", (3, 6, 0)), ("3.7.1+git3f2", (3, 7, 1)),
                                          ("3.10", (3, 10)), ("3.5.0rc1", (3, 5, 0))])
def test_version_tuple(text, parsed):
    assert kernels.version_tuple(text) == parsed


@pytest.mark.parametrize("capability, triton, tilelang, refused", [
    ((9, 0), "3.6.0", False, True),     # H100/H200, torch 2.11's Triton
    ((9, 0), "3.4.0", False, True),
    ((9, 0), "3.7.0", False, True),
    ((9, 0), "3.7.1", False, False),    # fixed Triton
    ((9, 0), "3.3.1", False, False),
    ((9, 0), "3.6.0", True, False),     # tilelang's kernel instead
    ((8, 0), "3.6.0", False, False),    # A100
    ((10, 0), "3.6.0", False, False),   # Blackwell
    (None, "3.6.0", False, False),      # no GPU
    ((9, 0), None, False, False),       # no Triton: fla cannot run anyway
])
def test_gated_backward_problem(capability, triton, tilelang, refused):
    problem = kernels.gated_backward_problem(capability, triton, tilelang)
    assert (problem is not None) == refused
    if refused:
        assert f"compute capability 9.0) with Triton {triton}" in problem
        assert "`pip install tilelang`" in problem and "Triton >= 3.7.1" in problem


def test_the_preflight_refuses_qwen3_5_on_such_a_gpu(monkeypatch, tiny_model_dir, tmp_path):
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.errors import UserError
    from swift_megatron.preflight import preflight_rlhf

    monkeypatch.setattr(kernels, "gdn_kernel_problem", lambda: "the kernel problem")
    base = ["--model", tiny_model_dir("qwen3_5"), "--dataset", "d.jsonl", "--output_dir",
            str(tmp_path)]
    args = parse_command(RlhfArguments, base, "megatron rlhf")
    with pytest.raises(UserError, match="^qwen3_5: the kernel problem$"):
        preflight_rlhf(args, 1)
    cpu = parse_command(RlhfArguments, base + ["--device", "cpu"], "megatron rlhf")
    preflight_rlhf(cpu, 1)   # the torch path runs on the CPU: nothing to refuse
    dense = parse_command(RlhfArguments, [*base[:0], "--model", tiny_model_dir("qwen3"),
                                          *base[2:]], "megatron rlhf")
    preflight_rlhf(dense, 1)
