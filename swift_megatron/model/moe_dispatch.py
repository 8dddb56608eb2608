"""Token dispatch of the MoE layers without host synchronisation or per-expert Python work.

megatron-core 0.16.1's all-to-all dispatcher, without Transformer Engine's fused permutation,
sorts the routed tokens by expert with `masked_select` (on a GPU the host must read how many
elements it selected: a device synchronisation, three per layer and micro-batch), copies the
token counts to the host and waits for them (with several local experts), and even when no
token leaves the rank splits and re-concatenates the tokens per expert in Python.

`Dispatcher` (megatron's class with these parts replaced; `use_device_dispatch` installs it in
a built model, model/build.py) keeps each micro-batch's routing on the device:

    routing_of   from the router's [tokens, experts] map: each token's k experts, the order
                 that sorts the token-expert pairs by expert (stable: tokens ascending within an
                 expert, megatron's order) and its inverse; argsorts, no data-dependent shape
    permute      the expert-sorted copy of the tokens: one gather (`index_select`); its
                 backward sums each token's k gradient rows with one gather and a sum (no
                 scatter-add atomics)
    unpermute    each token's k expert outputs summed back in token order (the router
                 probabilities are applied inside the experts, as megatron does): one gather and
                 a sum; its backward is one gather

With no expert or expert-tensor parallelism (EP = ETP = 1) nothing else happens: the token
counts stay on the device for the grouped experts (model/grouped_experts.py), so a layer's
forward and backward never wait on the host. With EP or ETP > 1 megatron's all-to-all and
all-gather need the split sizes on the host (one synchronisation per layer forward, inherent to
variable-size collectives) and megatron's code does the communication between the two
permutations; its sort of the received tokens by local expert (EP x local experts chunks, split
and concatenated one by one there) is one gather here (`sort_chunks`). Token dropping
(`--moe_expert_capacity_factor`), whose routed-token count the host must know, runs megatron's
path unchanged.
"""
import contextlib
import dataclasses

import torch
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


@dataclasses.dataclass(frozen=True)
class Routing:
    """One micro-batch's routing: `experts` [T, k] each token's experts (ascending), `order`
    [T k] the (token, slot) pair (flat, token-major) of each expert-sorted row, `source` [T k]
    its token, `inverse` [T k] the expert-sorted row of each pair."""

    experts: torch.Tensor
    order: torch.Tensor
    source: torch.Tensor
    inverse: torch.Tensor


def routing_of(routing_map: torch.Tensor, topk: int) -> Routing:
    """The Routing of a [tokens, experts] boolean map with exactly `topk` experts per token."""
    experts = routing_map.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :topk]
    order = experts.reshape(-1).argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device))
    return Routing(experts, order, order.div(topk, rounding_mode="floor"), inverse)


def _sum_slots(rows: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
    """[T k, H] expert-sorted rows -> [T, H]: each token's k rows summed."""
    return rows.index_select(0, inverse).view(-1, topk, rows.shape[-1]).sum(1)


class _Permute(torch.autograd.Function):
    """tokens [T, H] -> their expert-sorted copies [T k, H]."""

    @staticmethod
    def forward(ctx, tokens, source, inverse, topk):
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return tokens.index_select(0, source)

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        return _sum_slots(grad, inverse, ctx.topk), None, None, None


class _Unpermute(torch.autograd.Function):
    """expert outputs [T k, H], expert-sorted -> each token's sum [T, H] (permute's adjoint)."""

    @staticmethod
    def forward(ctx, rows, source, inverse, topk):
        ctx.save_for_backward(source)
        return _sum_slots(rows, inverse, topk)

    @staticmethod
    def backward(ctx, grad):
        source, = ctx.saved_tensors
        return grad.index_select(0, source), None, None, None


def chunk_gather_index(sizes: torch.Tensor, order: torch.Tensor, total: int,
                       device: torch.device) -> torch.Tensor:
    """The row index that puts chunks of `sizes` rows (in a tensor of `total` rows) in the
    order `order`, computed on `device` without reading the sizes on the host."""
    sizes, order = sizes.to(device, non_blocking=True), order.to(device, non_blocking=True)
    moved = sizes[order]
    shift = (sizes.cumsum(0) - sizes)[order] - (moved.cumsum(0) - moved)
    return torch.arange(total, device=device) + shift.repeat_interleave(moved, output_size=total)


class _Reorder(torch.autograd.Function):
    """rows [N, ...] -> rows[index] for a permutation `index`; backward by its inverse."""

    @staticmethod
    def forward(ctx, rows, index):
        ctx.save_for_backward(index)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        index, = ctx.saved_tensors
        inverse = torch.empty_like(index).scatter_(
            0, index, torch.arange(index.numel(), device=index.device))
        return grad.index_select(0, inverse), None


def sort_chunks(tokens, split_sizes, sorted_idxs, probs=None, fused=False):
    """megatron's `sort_chunks_by_idxs` (the all-to-all output sorted by local expert and back)
    as one gather per tensor, where megatron splits and concatenates chunk by chunk."""
    index = chunk_gather_index(split_sizes, sorted_idxs, tokens.shape[0], tokens.device)
    return (_Reorder.apply(tokens, index),
            None if probs is None else _Reorder.apply(probs, index))


@contextlib.contextmanager
def _gathered_chunk_sort():
    """megatron's dispatcher code with `sort_chunks` as its chunk sort, for one call."""
    megatrons = token_dispatcher.sort_chunks_by_idxs
    token_dispatcher.sort_chunks_by_idxs = sort_chunks
    try:
        yield
    finally:
        token_dispatcher.sort_chunks_by_idxs = megatrons


def permute(tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
    return _Permute.apply(tokens, routing.source, routing.inverse, routing.experts.shape[1])


def unpermute(rows: torch.Tensor, routing: Routing) -> torch.Tensor:
    return _Unpermute.apply(rows, routing.source, routing.inverse, routing.experts.shape[1])


def permuted_probs(probs: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The router probability of each expert-sorted row, from the [tokens, experts] probs."""
    flat = probs.gather(1, routing.experts).reshape(-1)
    return flat.index_select(0, routing.order)


class Dispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher with the device-side permutations (module docstring)."""

    def _ours(self) -> bool:
        """Dropless routing (every token has its k experts): the permutations are ours."""
        return (self.config.moe_expert_capacity_factor is None and not self.drop_and_pad
                and not self.config.moe_router_padding_for_quantization)

    def _local(self) -> bool:
        """Nothing crosses ranks (EP = ETP = 1) and the routing is dropless."""
        return self.ep_size == 1 and self.tp_size == 1 and self._ours()

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        if not self._ours():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape, self.probs, self.routing_map = hidden_states.shape, probs, routing_map
        tokens = hidden_states.view(-1, self.hidden_shape[-1])
        if self._local():
            self.tokens_per_expert = routing_map.sum(dim=0)
        else:   # megatron's split sizes and counts, copied to the host
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
                "before_permutation_1", self.preprocess(routing_map))
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        self.routing = routing_of(routing_map, self.config.moe_router_topk)
        return permute(tokens, self.routing), permuted_probs(probs, self.routing)

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        if self._local():
            return permutated_local_input_tokens, permuted_probs
        return super().token_dispatch(permutated_local_input_tokens, permuted_probs)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if not self._ours():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if not self._local():
            with _gathered_chunk_sort():
                return super().dispatch_postprocess(global_input_tokens, global_probs)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if self._local():
            return hidden_states
        if not self._ours():
            return super().combine_preprocess(hidden_states)
        with _gathered_chunk_sort():
            return super().combine_preprocess(hidden_states)

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        return hidden_states if self._local() else super().token_combine(hidden_states)

    def combine_postprocess(self, permutated_local_input_tokens):
        if not self._ours():
            return super().combine_postprocess(permutated_local_input_tokens)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        output = unpermute(permutated_local_input_tokens, self.routing).view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


def use_device_dispatch(model: torch.nn.Module) -> None:
    """Give every MoE layer of `model` whose dispatcher is megatron's all-to-all one the methods
    of `Dispatcher` (the instance megatron built, with its streams and shared-expert overlap
    set up, keeps its state; only its class changes)."""
    for module in model.modules():
        if isinstance(module, MoELayer) and \
                type(module.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            module.token_dispatcher.__class__ = Dispatcher
