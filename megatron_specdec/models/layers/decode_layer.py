"""A transformer layer whose decoding forward skips megatron's per-call machinery.

A decode step of a small model on a CPU is mostly overhead around the arithmetic: per layer,
megatron's TransformerLayer runs recompute and offload handlers, TP mapping autograd
functions around every linear, nvtx ranges, bias-dropout-add factories and about fifteen
module calls, which on a 2-core machine cost more than the layer's four weight products
(bench/bench_decode_step.py). Under a DecodeCache without grad, `DecodeTransformerLayer`
runs `decode` instead: the same tensor ops in the same order (norm, QKV, RoPE, cache,
attention, projection, residual, norm, fc1, activation, fc2, residual), so its output is
the one forward gives (tests/test_decode_layer.py). Layers it cannot reproduce (MoE,
Transformer Engine modules, recompute, fused activations) keep forward.

In float32 with the extension built, the RMSNorms, the gated SiLU and a batch-1 chain's
RoPE, cache write and attention run as one C++ op each (csrc/decode_ops.cpp): equal to
PyTorch's ops within float32 rounding, and row-invariant like the small-row products, so a
verify forward and plain steps still see bitwise the same logits. Where every part of a layer
takes those ops and the skinny product, a batch-1 chain runs the whole layer, and where every
layer of the stage does, all of them (inference/generation.py), as the one decode_layers op
(csrc/decode_layer.cpp): the same kernels in the same order, in one parallel region, without a
dispatch and a Python call between them.
"""

import math
import time
from functools import cached_property

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_specdec.acceptance.ops import op_available
from megatron_specdec.models.layers.decode_attention import DecodeCache, DecodeSelfAttention
from megatron_specdec.models.layers.linear_kernels import (
    INVARIANT_ROWS,
    PANEL_SCHEDULE,
    SKINNY_SCHEDULES,
    product,
    run_choice,
    skinny_schedule,
)
from megatron_specdec.models.layers.small_rows_linear import decode_linear, plain_decoding_linear
from megatron_specdec.models.weight_memory import (
    drop_panel_copies,
    panel_copy,
    panel_width,
    panels_take,
    room_for_panels,
    streamed,
)

# The arguments `decode` takes; another one given (not None) keeps forward.
_DECODE_KWARGS = frozenset(("hidden_states", "attention_mask", "inference_context"))


def lean_mlp(mlp) -> bool:
    """Whether mlp_decode computes `mlp`'s forward: a dense MLP of small-row linears with the
    unfused activation."""
    config = mlp.config
    return (type(mlp) is MLP and plain_decoding_linear(mlp.linear_fc1)
            and plain_decoding_linear(mlp.linear_fc2)
            and not config.use_te_activation_func and not config.bias_activation_fusion
            and getattr(config, "activation_func_clamp_value", None) is None)


def fused_silu(mlp) -> bool:
    """Whether the MLP's activation is a gated SiLU the C++ op computes (float32)."""
    config = mlp.config
    return (config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
            and config.glu_linear_offset == 0 and config.params_dtype == torch.float32
            and op_available("silu_mul"))


def fused_norm(norm) -> bool:
    """Whether `norm` is a float32 torch RMSNorm the C++ op computes."""
    return (type(norm) is torch.nn.RMSNorm and norm.weight is not None
            and norm.weight.dtype == torch.float32 and op_available("rms_norm"))


def norm_eps(norm, dtype) -> float:
    """The epsilon torch's RMSNorm `norm` uses for `dtype`."""
    return torch.finfo(dtype).eps if norm.eps is None else norm.eps


def norm_decode(norm, x, fused: bool):
    """The norm's output: the C++ op where `fused` (fused_norm), else the module."""
    if fused and x.dtype == torch.float32:
        return torch.ops.megatron_specdec.rms_norm(x, norm.weight, norm_eps(norm, x.dtype))
    return norm(x)


def mlp_decode(mlp, hidden, fused: bool = False):
    """(output, bias) of megatron's MLP.forward (unfused activation, no per-token scale);
    `fused` (fused_silu): the gated SiLU as one C++ op."""
    config = mlp.config
    x, bias = decode_linear(mlp.linear_fc1, hidden)
    if bias is not None:
        x = x + bias
    if fused and x.dtype == torch.float32:
        x = torch.ops.megatron_specdec.silu_mul(x)
    elif config.gated_linear_unit:
        gate, linear = torch.chunk(x, 2, dim=-1)
        x = config.activation_func(gate) * (linear + config.glu_linear_offset)
    else:
        x = mlp.activation_func(x)
    return decode_linear(mlp.linear_fc2, x)


def residual_add(out, bias, residual):
    """megatron's bias-dropout-add in eval: out (+ bias), plus the residual."""
    if residual.dtype != out.dtype:
        residual = residual.to(out.dtype)
    if bias is not None:
        out = out + bias
    return out + residual


class LayerOp:
    """What a decoding layer (a base layer, an EAGLE3 draft layer) needs to run as the
    decode_layers op: its four products, the conditions every such layer shares, the skinny
    op's schedules and whether a call takes the op. The layer adds its own conditions
    (`layer_op`) and operands (`op_weights`)."""

    @property
    def linears(self) -> tuple:
        """The four weight products, in the decode_layers op's order: QKV, output, fc1, fc2."""
        attention, mlp = self.self_attention, self.mlp
        return attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2

    def products_take_op(self) -> bool:
        """The shared conditions: a chain-op attention, the extension built, one TP rank, no
        fp32 residual, every weight product the skinny op on this machine."""
        linears = self.linears
        return (self.self_attention.chain_op and op_available("decode_layers")
                and all(linear.tp_group.size() == 1 for linear in linears)
                and not self.config.fp32_residual_connection
                and all(skinny_schedule(product(linear.weight, 1)) is not None for linear in linears))

    @cached_property
    def schedule_memo(self) -> dict:
        """{rows (at most INVARIANT_ROWS): the skinny op's schedule for each of the layer's four
        products}, filled as row counts come; a chain longer than INVARIANT_ROWS (a prefill)
        takes the widest bucket's, as the op computes every row with the skinny product."""
        return {}

    def schedules(self, rows: int) -> list:
        """The skinny op's schedule for each of the four products at `rows` rows."""
        rows = min(rows, INVARIANT_ROWS)
        found = self.schedule_memo.get(rows)
        if found is None:
            found = self.schedule_memo[rows] = [skinny_schedule(product(linear.weight, rows))
                                                for linear in self.linears]
        return found

    def whole(self, hidden_states, cache: DecodeCache) -> bool:
        """Whether `decode` of `hidden_states` runs as the decode_layers op: a batch-1 chain
        over a rotary cache, float32, a layer that takes it."""
        return (cache.chain_start() is not None and cache.rotary is not None and self.layer_op
                and hidden_states.dtype == torch.float32)


class DecodeTransformerLayer(LayerOp, TransformerLayer):
    """megatron's TransformerLayer with the decoding path above; parameters, checkpoints and
    every other forward unchanged."""

    def forward(self, *args, **kwargs):
        cache = kwargs.get("inference_context")
        if (not args and self.decodes(cache)
                and all(v is None for k, v in kwargs.items() if k not in _DECODE_KWARGS)):
            return self.decode(kwargs["hidden_states"], kwargs.get("attention_mask"), cache), None
        return super().forward(*args, **kwargs)

    def decodes(self, cache) -> bool:
        """Whether a call of this layer over `cache` (hidden states, attention mask and the
        cache, nothing else) runs `decode`."""
        return (isinstance(cache, DecodeCache) and not torch.is_grad_enabled()
                and not self.training and self.lean)

    def direct_decode(self, cache) -> bool:
        """Whether a caller may run `decode` itself instead of calling the module: it decodes
        and no hook would see the call. megatron's call path (CUDA graph checks, then
        nn.Module's) costs ~0.1 ms a layer on a 2-core CPU, ~7% of a SmolLM2 step."""
        return self.decodes(cache) and not (self._forward_hooks or self._forward_pre_hooks)

    @cached_property
    def lean(self) -> bool:
        """Whether `decode` computes what forward does for this layer."""
        return (isinstance(self.self_attention, DecodeSelfAttention) and self.self_attention.lean
                and lean_mlp(self.mlp) and isinstance(self.cross_attention, IdentityOp)
                and not (self.recompute_input_layernorm or self.recompute_pre_mlp_layernorm
                         or self.recompute_mlp)
                and not getattr(self.config, "inference_fuse_tp_communication", False)
                and not getattr(self, "offload_attn_norm", False)
                and not getattr(self, "offload_mlp_norm", False))

    @cached_property
    def fused(self) -> tuple:
        """Which of (input norm, pre-MLP norm, activation) run as C++ ops."""
        return (fused_norm(self.input_layernorm), fused_norm(self.pre_mlp_layernorm),
                fused_silu(self.mlp))

    @cached_property
    def layer_op(self) -> bool:
        """Whether a batch-1 chain can run the whole layer as the decode_layers op: every part
        one of the ops above, the shared conditions (LayerOp.products_take_op), and no bias but
        the QKV product's own."""
        linears = self.linears
        return (all(self.fused) and all(linear.bias is None for linear in linears[1:])
                and (linears[0].bias is None or not linears[0].skip_bias_add)
                and self.products_take_op())

    def decode(self, hidden_states, attention_mask, cache: DecodeCache):
        """The layer's output [s, b, h] for new tokens `hidden_states` over `cache`."""
        if self.whole(hidden_states, cache):
            return decode_chain([self], hidden_states, cache)[0]
        input_norm, mlp_norm, silu = self.fused
        out, bias = self.self_attention.decode(
            norm_decode(self.input_layernorm, hidden_states, input_norm), attention_mask, cache)
        hidden_states = residual_add(out, bias, hidden_states)
        out, bias = mlp_decode(self.mlp, norm_decode(self.pre_mlp_layernorm, hidden_states,
                                                     mlp_norm), silu)
        return residual_add(out, bias, hidden_states)

    @cached_property
    def _op_operands(self) -> tuple:
        """(norms and bias, products, epsilons) of the decode_layers op, gathered once: fetched
        per call through the submodules they cost ~20 us a layer, ~2% of a SmolLM2 step on 2
        cores."""
        attention, mlp = self.self_attention, self.mlp
        dtype = attention.linear_qkv.weight.dtype
        return ((self.input_layernorm.weight, attention.linear_qkv.bias,
                 self.pre_mlp_layernorm.weight),
                (attention.linear_qkv.weight, attention.linear_proj.weight,
                 mlp.linear_fc1.weight, mlp.linear_fc2.weight),
                [norm_eps(self.input_layernorm, dtype), norm_eps(self.pre_mlp_layernorm, dtype),
                 0.0])

    @property
    def op_weights(self) -> tuple:
        """(weights, epsilons) the decode_layers op takes for this layer, each product's weight
        as `streamed` gives it (a base trained in bf16 streams half the bytes)."""
        (norm1, bias, norm2), (qkv, proj, fc1, fc2), eps = self._op_operands
        return ([norm1, streamed(qkv), bias, streamed(proj), norm2, streamed(fc1), streamed(fc2),
                 None], eps)


# A run's schedule options are timed in up to RUN_ROUNDS interleaved rounds, fewer once past two
# the timing has taken RUN_BUDGET_S.
RUN_ROUNDS = 5
RUN_BUDGET_S = 1.0
# A layer's operands in the decode_layers op (op_weights), and where its four products are.
OP_WEIGHTS_PER_LAYER = 8
OP_PRODUCTS = (1, 3, 5, 6)


def run_key(weights) -> str:
    """A run of decoding layers named by its products' shapes and weight dtypes, a layer's four
    at a time, consecutive equal layers counted
    ("30 x 960x576 576x576 3072x576 576x1536 float32")."""
    layers = []
    for i in range(0, len(weights), OP_WEIGHTS_PER_LAYER):
        products = [weights[i + j] for j in OP_PRODUCTS]
        layer = " ".join(f"{w.shape[0]}x{w.shape[1]}" for w in products)
        layer += " " + "/".join(sorted({str(w.dtype).removeprefix("torch.") for w in products}))
        if layers and layers[-1][1] == layer:
            layers[-1][0] += 1
        else:
            layers.append([1, layer])
    return ", ".join(f"{n} x {layer}" for n, layer in layers)


def run_products(weights) -> list:
    """The product weights of a run's op_weights, in the order of its schedules."""
    return [weights[i + j] for i in range(0, len(weights), OP_WEIGHTS_PER_LAYER)
            for j in OP_PRODUCTS]


def with_panels(weights, schedules) -> list:
    """The decode_layers op's weights under `schedules`: a product taking PANEL_SCHEDULE reads
    its panel copy (weight_memory.panel_copy)."""
    if PANEL_SCHEDULE not in schedules:
        return weights
    weights = list(weights)
    for i, schedule in enumerate(schedules):
        if schedule == PANEL_SCHEDULE:
            at = i // 4 * OP_WEIGHTS_PER_LAYER + OP_PRODUCTS[i % 4]
            weights[at] = panel_copy(weights[at])
    return weights


def panels_fit(weights) -> bool:
    """Whether every product of a run can read panels: each shape takes them, fc1's gate and up
    halves are whole panels each (the op splits them alike), and the memory has room for the
    copies. Nothing is copied here: the copies are made as a call reads them (with_panels)."""
    width = panel_width()
    products = run_products(weights)
    return (width > 0 and all(w.shape[0] // 2 % width == 0 for w in products[2::4])
            and all(panels_take(w) for w in products) and room_for_panels(products))


def run_schedules(layers, rows: int, weights, call) -> list:
    """The skinny op's schedules of a run of decoding layers at `rows` rows: each product's own
    (linear_kernels' choice, timed one shape at a time) or one schedule for every product,
    whichever ran the run fastest on this machine (`call(schedules)` runs it). Timed alone, a
    shape's schedules can rank otherwise than inside a step, where the products of thirty
    layers stream one after another in one parallel region (AMD EPYC Zen 5, a SmolLM2 forward
    at one row: 14.9 ms with the shapes' own, 12.8 ms with the one-row block for every product;
    bench/results/decode_step_zen5_run_choice_26291ec.json). A prefill (more rows than
    INVARIANT_ROWS) keeps the shapes' own. Where the products fit panels (panels_fit), one more
    option reads them all from their panel copies, made as a call first reads them: a timing
    that does not choose them frees them again (nothing else does, so a run gathered for each
    new cache neither repacks nor drops what another row bucket took)."""
    per_shape = [schedule for layer in layers for schedule in layer.schedules(rows)]
    if rows > INVARIANT_ROWS:
        return per_shape
    options = {"per_shape": per_shape,
               **{name: [schedule] * len(per_shape) for name, schedule in SKINNY_SCHEDULES.items()}}
    if panels_fit(weights):
        options["skinny_panel"] = [PANEL_SCHEDULE] * len(per_shape)

    measured = []

    def measure() -> dict:
        measured.append(True)
        best = dict.fromkeys(options, math.inf)
        start = time.perf_counter()
        for done in range(1, RUN_ROUNDS + 1):
            for name, schedules in options.items():
                begin = time.perf_counter()
                call(schedules)
                best[name] = min(best[name], (time.perf_counter() - begin) * 1e3)
            if done >= 2 and time.perf_counter() - start > RUN_BUDGET_S:
                break
        return best

    chosen = options.get(run_choice(run_key(weights), rows, tuple(options), measure), per_shape)
    if measured and PANEL_SCHEDULE not in chosen:
        drop_panel_copies(run_products(weights))  # made for the timing only
    return chosen


def decode_chain(layers, hidden_states, cache: DecodeCache, capture=(), embeds=None) -> list:
    """The outputs of `layers` (consecutive decoding layers whose `whole` holds) named in
    `capture` (indices into `layers`), then the last one's, for a batch-1 chain over `cache`:
    one decode_layers op, so the threads stay in one parallel region for the whole run.
    `embeds`: the first layer is an EAGLE3 first layer reading them beside the hidden states.
    The layers' cache buffers, heads and schedules (run_schedules) are gathered once per cache
    and chain length (~0.3 ms a SmolLM2 step in Python); the weights every call (a draft's
    16-bit copies follow its values). The op writes the chain's cache slots from its inputs
    alone, so timing it on a real call leaves the cache and the result as one call does."""
    s = hidden_states.shape[0]
    weights, eps = _run_weights(layers)
    cos, sin = cache.chain_cos_sin(hidden_states)

    def call(operands, schedules):
        return _decode_layers(hidden_states, with_panels(weights, schedules), eps, cos, sin,
                              operands, cache.chain_start(), schedules, capture, embeds)

    key = (id(layers[0]), len(layers), s)
    memo = cache.memo.get(key)
    if memo is None:
        operands = [], [], [], []
        for layer in layers:
            parts = layer.self_attention.chain_cache(cache, hidden_states)
            for found, part in zip(operands, parts):
                found.append(part)
        schedules = run_schedules(layers, s, weights, lambda schedules: call(operands, schedules))
        memo = cache.memo[key] = (operands, schedules)
    return call(*memo)


def _run_weights(layers) -> tuple:
    """(weights, epsilons) the decode_layers op takes for a run of layers (op_weights)."""
    weights, eps = [], []
    for layer in layers:
        layer_weights, layer_eps = layer.op_weights
        weights += layer_weights
        eps += layer_eps
    return weights, eps


def _decode_layers(hidden_states, weights, eps, cos, sin, operands, start, schedules, capture,
                   embeds) -> list:
    keys, values, heads, scales = operands
    return torch.ops.megatron_specdec.decode_layers(
        hidden_states, weights, eps, cos, sin, keys, values, start, heads, scales, schedules,
        list(capture), embeds)


class FrozenChainStep:
    """decode_chain of s tokens of a run of layers whose weights hold still while `cache`
    lives (a frozen base while a runner decodes): the weights, the panel copies and the cache
    operands that decode_chain gathered for chains of s tokens (its memo in `cache`, so built
    after one such call) are taken once, and a forward is the op alone. Python between the
    layers' streams costs more than its own time (each forward's first code and data come
    back from memory: RESULTS.md, "The time outside the ops")."""

    def __init__(self, layers, cache: DecodeCache, capture=(), s: int = 1):
        operands, schedules = cache.memo[(id(layers[0]), len(layers), s)]
        weights, self.eps = _run_weights(layers)
        self.weights = with_panels(weights, schedules)
        self.operands, self.schedules, self.capture = operands, schedules, list(capture)

    def __call__(self, hidden_states, cos, sin, start: int) -> list:
        """The op's outputs (the captured layers', then the last one's) for hidden_states
        [s, 1, h] at slots start.., cos and sin [s, rotary dim] of their RoPE positions."""
        return _decode_layers(hidden_states, self.weights, self.eps, cos, sin, self.operands,
                              start, self.schedules, self.capture, None)
