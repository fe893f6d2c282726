"""ModuleSpecs of the draft modules, from megatron-core's local (pure PyTorch) backend.

The draft uses megatron-core's own ColumnParallelLinear / RowParallelLinear /
DotProductAttention on every machine (their small-row and SDPA inference forms, see
small_rows_linear.py and decode_attention.py), so its parameter layout does not depend on
whether Transformer Engine is installed (the base model may use either).
"""

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_specdec.methods.eagle3.draft_layer import (
    Eagle3Attention,
    Eagle3Layer,
    Eagle3LayerSubmodules,
    Eagle3QKVLinear,
)
from megatron_specdec.methods.eagle3.layers import Eagle3Module, Eagle3ModuleSubmodules
from megatron_specdec.models.layers.decode_attention import SDPAttention
from megatron_specdec.methods.medusa.layers import MedusaHeads
from megatron_specdec.models.layers.small_rows_linear import (
    SmallRowsColumnParallelLinear,
    SmallRowsRowParallelLinear,
)


def eagle3_layer_spec(first: bool, use_input_layernorm: bool = True,
                      qk_layernorm: bool = False) -> ModuleSpec:
    backend = LocalSpecProvider()
    norm = backend.layer_norm(rms_norm=True)
    qk_norm = backend.layer_norm(rms_norm=True, for_qk=True) if qk_layernorm else IdentityOp
    attention = ModuleSpec(
        module=Eagle3Attention,
        params={"attn_mask_type": AttnMaskType.arbitrary},
        submodules=SelfAttentionSubmodules(
            linear_qkv=Eagle3QKVLinear if first else SmallRowsColumnParallelLinear,
            core_attention=SDPAttention,
            linear_proj=SmallRowsRowParallelLinear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )
    return ModuleSpec(
        module=Eagle3Layer,
        params={"first": first},
        submodules=Eagle3LayerSubmodules(
            input_layernorm=norm if (use_input_layernorm or not first) else IdentityOp,
            hidden_norm=norm if first else IdentityOp,
            self_attention=attention,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=SmallRowsColumnParallelLinear, linear_fc2=SmallRowsRowParallelLinear)),
        ),
    )


def eagle3_module_spec(cfg, qk_layernorm: bool = False) -> ModuleSpec:
    """`cfg` is an Eagle3Config."""
    norm = LocalSpecProvider().layer_norm(rms_norm=True)
    layers = [
        eagle3_layer_spec(i == 0, cfg.use_input_layernorm_in_first_layer, qk_layernorm)
        for i in range(cfg.eagle_num_layers)
    ]
    return ModuleSpec(
        module=Eagle3Module,
        submodules=Eagle3ModuleSubmodules(
            layers=layers, final_layernorm=norm if cfg.use_last_layernorm else IdentityOp
        ),
    )


def medusa_spec() -> ModuleSpec:
    return ModuleSpec(module=MedusaHeads)
