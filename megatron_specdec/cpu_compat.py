"""Workarounds that let megatron-core run on a CPU-only machine (gloo backend).

megatron-core assumes CUDA in a handful of places. Each patch below is applied only when
CUDA is absent, is idempotent, and carries a one-line reason. Nothing else in the project
special-cases the CPU: on a GPU machine `apply()` only fills in the one name megatron-core
leaves undefined without Transformer Engine (`_moe_router_gemm_patch`).
"""

import contextlib

import torch

_APPLIED = False


def _cpu_device():
    return torch.device("cpu")


def _rng_state_patches():
    """CudaRNGStatesTracker keeps CUDA generator states: keep CPU generator states instead."""
    from megatron.core.tensor_parallel import random as tp_random

    def _get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    def _set_rng_state(new_state, *args, **kwargs):
        torch.set_rng_state(new_state)

    tp_random._get_cuda_rng_state = _get_rng_state
    tp_random._set_cuda_rng_state = _set_rng_state

    def add(self, name, seed):
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name=tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    tp_random.CudaRNGStatesTracker.add = add
    tp_random.CudaRNGStatesTracker.fork = fork


def _causal_mask_patch():
    """get_default_causal_mask builds its mask with device="cuda": build it on the CPU."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def get_default_causal_mask(sq):
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "empty_like")


def _device_literal_patch():
    """Pipeline schedules, dist_checkpointing and the float16 loss scaler allocate with
    device="cuda" literals: their module-level `torch` is replaced by a proxy whose tensor
    factories map "cuda" to the CPU."""
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.dist_checkpointing.strategies import state_dict_saver
    from megatron.core.optimizer import grad_scaler
    from megatron.core.pipeline_parallel import schedules

    def cpu_factory(factory):
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    class _TorchOnCpu:
        def __getattr__(self, name):
            value = getattr(torch, name)
            return cpu_factory(value) if name in _FACTORIES else value

    for module in (schedules, exchange_utils, state_dict_saver, grad_scaler):
        module.torch = _TorchOnCpu()


def _moe_router_gemm_patch():
    """moe_utils' router gating linear tests `te_general_gemm is not None`, a name it imports
    only with Transformer Engine: without TE (on CPUs and GPUs alike) every MoE forward raises
    NameError. None selects its torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply():
    """Apply every CPU workaround once, only when CUDA is not available (the MoE router's
    missing name is filled in on any machine)."""
    global _APPLIED
    if _APPLIED:
        return
    _moe_router_gemm_patch()
    if torch.cuda.is_available():
        return
    # ~100 call sites pass torch.cuda.current_device() as a device (RoPE, TP mappings, p2p).
    torch.cuda.current_device = _cpu_device
    # Tied embeddings under PP (LanguageModule) and other call sites move tensors with .cuda().
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # dist_checkpointing and the schedules synchronise the CUDA stream unconditionally.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _rng_state_patches()
    _causal_mask_patch()
    _device_literal_patch()
    _APPLIED = True


# TransformerConfig fields whose fused kernels exist only on CUDA (apex/TE/triton).
CPU_UNFUSED_CONFIG = dict(
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    batch_p2p_sync=False,
)
