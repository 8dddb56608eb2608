"""Milliseconds of the trainer's output layer + log-probability math alone (model/logprobs.py
`head_logprobs`), eager against torch.compile'd chunk functions, on random bf16 hidden states and
output weight of a real vocabulary size: the logprob passes' forward (old / reference policy) and
the training pass (forward with entropy, then backward into the hidden states and the weight).
One JSON line per mode (with the peak memory) and one with the ratios compiled / eager.
Feeds docs/gpu.md, "Kernels and single-step benchmarks" (device_run.sh's logprobs_kernel).

    python benchmarks/logprobs_kernel.py                          # GPU: 8192 x 1536 x 151936
    python benchmarks/logprobs_kernel.py --device cpu --tokens 256 --vocab 4096 --repeat 2
"""
import argparse
import json
import time


def timed(fn, repeat: int, sync) -> float:
    fn()   # warm-up: compiles on the first call
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat * 1000


def run(a) -> list:
    import torch

    from swift_megatron.model import logprobs
    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(device=a.device)
    sync = torch.cuda.synchronize if state.device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=state.device).manual_seed(0)
    hidden = torch.randn(a.tokens, a.hidden, device=state.device, generator=gen).bfloat16()
    weight = (torch.randn(a.vocab, a.hidden, device=state.device, generator=gen)
              * 3 / a.hidden ** 0.5).bfloat16()
    targets = torch.randint(0, a.vocab - 64, (a.tokens,), device=state.device, generator=gen)
    real = a.vocab - 64   # a padded vocabulary, as megatron's output layer has

    def forward():
        with torch.no_grad():
            return logprobs.head_logprobs(hidden, weight, targets, 0.9, real)

    def train():
        leaf, rows = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        lp, _ = logprobs.head_logprobs(leaf, rows, targets, 0.9, real, with_entropy=True)
        lp.sum().backward()
        return lp.detach(), leaf.grad, rows.grad

    lines, results = [], {}
    for mode in (False, True):
        logprobs.KERNELS.set_mode(mode)
        name = "compiled" if mode else "eager"
        if state.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        results[name] = tuple(t.cpu() for t in (forward(), *train()))  # off the GPU: not in
        # the next mode's peak
        lines.append(dict(mode=name, tokens=a.tokens, vocab=a.vocab,
                          forward_ms=round(timed(forward, a.repeat, sync), 2),
                          train_ms=round(timed(train, a.repeat, sync), 2),
                          fell_back=mode and logprobs.KERNELS.failed,
                          peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2)
                          if state.device.type == "cuda" else None))
    # (logprobs, train logprobs, hidden grad, weight grad)
    eager, compiled = results["eager"], results["compiled"]
    lines.append(dict(ratio="compiled/eager",
                      forward=round(lines[1]["forward_ms"] / lines[0]["forward_ms"], 3),
                      train=round(lines[1]["train_ms"] / lines[0]["train_ms"], 3),
                      max_abs_diff_logprobs=(eager[0] - compiled[0]).abs().max().item(),
                      max_abs_diff_grad=(eager[2].float() - compiled[2].float()).abs().max().item(),
                      max_abs_diff_weight_grad=(eager[3].float() - compiled[3].float()).abs().max()
                      .item()))
    ParallelState.destroy()
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936, help="rows of the output weight")
    parser.add_argument("--hidden", type=int, default=1536, help="the hidden size")
    parser.add_argument("--repeat", type=int, default=10)
    for line in run(parser.parse_args()):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
