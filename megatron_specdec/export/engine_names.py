"""What vLLM, SGLang and TensorRT-LLM load from a one-layer EAGLE3 draft directory.

Each `EngineLoader` restates an engine's loader as data: how it renames an HF tensor name to
its own parameter (stacked parameters as `name[shard]`), the shape each parameter (shard)
has for a given config.json, what it takes from the target model, and the config.json keys it
reads. `check(loader, config, tensors)` replays the loader on an export and lists problems.
Read from the engines' sources (retrieved with the code search, 2026-11):

- vLLM: vllm-project/vllm vllm/model_executor/models/llama_eagle3.py (LlamaDecoderLayer,
  LlamaModel.load_weights, Eagle3LlamaForCausalLM.load_weights: `midlayer.` -> `layers.0.`,
  `d2t` -> `draft_id_to_target_id`, `t2d` skipped, `model.` prefix except lm_head, q/k/v ->
  qkv_proj, gate/up -> gate_up_proj); aux ids: vllm/v1/worker/gpu/spec_decode/eagle/
  eagle3_utils.py reads the top-level `eagle_aux_hidden_state_layer_ids`; vLLM's llama.py
  captures the residual stream *entering* layer k (`if idx in aux_hidden_state_layers`
  before the layer runs), default (2, N//2, N-3).
- SGLang: sgl-project/sglang python/sglang/srt/models/llama_eagle3.py
  (LlamaForCausalLMEagle3.load_weights: `d2t` -> hot_token_id = d2t + arange, `t2d` skipped,
  unknown names silently ignored, `model.` prefix unless the name is a parameter;
  `tie_word_embeddings` true makes lm_head the embedding); aux ids: model_runner reads
  `eagle_config["eagle_aux_hidden_state_layer_ids"]` and llama.py set_eagle3_layers_to_capture
  adds 1 ("for the ith layer, it takes the output of the (i-1)th layer").
- TensorRT-LLM: NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py
  (Eagle3DraftModel, Eagle3DecoderLayer, Eagle3ForCausalLM.load_weights: `layers.0.` ->
  `midlayer.` for one layer, `model.` prefix except lm_head, `d2t` an int32 parameter only
  when draft_vocab_size != vocab_size, embed_tokens shared unless target_hidden_size differs);
  aux ids are not read from the draft: EagleDecodingConfig.eagle3_layers_to_capture
  (tensorrt_llm/llmapi/llm_args.py), default {1, N//2-1, N-4}, output-of-layer.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

_STACKED = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"),
            (".v_proj.", ".qkv_proj.", "v"), (".gate_proj.", ".gate_up_proj.", "0"),
            (".up_proj.", ".gate_up_proj.", "1"))


def _stack(name: str) -> str:
    for old, new, shard in _STACKED:
        if old in name:
            return f"{name.replace(old, new)}[{shard}]"
    return name


def _dims(c: dict):
    h = c["hidden_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    return (h, c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd,
            c["intermediate_size"], c["draft_vocab_size"], c.get("target_hidden_size", h))


def _layer_params(prefix: str, c: dict) -> dict:
    h, q, kv, inter, _, _ = _dims(c)
    p = prefix
    return {
        p + "self_attn.qkv_proj.weight[q]": (q, 2 * h),
        p + "self_attn.qkv_proj.weight[k]": (kv, 2 * h),
        p + "self_attn.qkv_proj.weight[v]": (kv, 2 * h), p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_up_proj.weight[0]": (inter, h), p + "mlp.gate_up_proj.weight[1]": (inter, h),
        p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
    }


def _head_params(c: dict, d2t_name: Optional[str]) -> dict:
    h, _, _, _, draft_vocab, target_h = _dims(c)
    out = {"model.fc.weight": (h, 3 * target_h), "model.norm.weight": (h,),
           "lm_head.weight": (draft_vocab, h), "model.embed_tokens.weight": (c["vocab_size"], h)}
    if d2t_name:
        out[d2t_name] = (draft_vocab,)
    return out


def _vllm_rename(name: str) -> Optional[str]:
    name = name.replace("midlayer.", "layers.0.")
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id"
    return _stack(name if name.startswith("lm_head") else "model." + name)


def _sglang_rename(name: str) -> Optional[str]:
    if name == "t2d":
        return None
    if name == "d2t":
        return "hot_token_id"  # not a parameter: d2t + arange, the target id of each draft id
    return _stack(name if name.startswith("lm_head") else "model." + name)


def _trtllm_rename(name: str) -> Optional[str]:
    if name == "t2d":
        return None  # no such module: the loader never reads it
    name = name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
    return _stack(name if name.startswith("lm_head") else "model." + name)


def _trtllm_params(c: dict) -> dict:
    d2t = "model.d2t" if c["draft_vocab_size"] != c["vocab_size"] else None
    return {**_layer_params("model.midlayer.", c), **_head_params(c, d2t)}


_LLAMA_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "rms_norm_eps", "num_hidden_layers", "vocab_size", "draft_vocab_size",
               "max_position_embeddings", "rope_theta")


@dataclass(frozen=True)
class EngineLoader:
    engine: str
    source: str
    rename: Callable[[str], Optional[str]]  # HF name -> parameter (None: read and dropped)
    params: Callable[[dict], Dict[str, Tuple[int, ...]]]
    from_target: Tuple[str, ...]  # parameters filled from the target model when not in the file
    config_keys: Tuple[str, ...]  # config.json keys whose value it uses (defaults are not ours)


ENGINES = {
    "vllm": EngineLoader(
        "vLLM", "vllm/model_executor/models/llama_eagle3.py", _vllm_rename,
        lambda c: {**_layer_params("model.layers.0.", c),
                   **_head_params(c, "draft_id_to_target_id")},
        ("model.embed_tokens.weight",),
        _LLAMA_KEYS + ("hidden_act", "head_dim", "eagle_aux_hidden_state_layer_ids")),
    "sglang": EngineLoader(
        "SGLang", "python/sglang/srt/models/llama_eagle3.py", _sglang_rename,
        lambda c: {**_layer_params("model.midlayer.", c), **_head_params(c, "hot_token_id")},
        ("model.embed_tokens.weight",),
        _LLAMA_KEYS + ("hidden_act", "head_dim", "tie_word_embeddings", "eagle_config")),
    "trtllm": EngineLoader(
        "TensorRT-LLM", "tensorrt_llm/_torch/models/modeling_speculative.py", _trtllm_rename,
        _trtllm_params, ("model.embed_tokens.weight",),
        _LLAMA_KEYS + ("head_dim", "torch_dtype")),
}


def check(loader: EngineLoader, config: dict, tensors: Dict[str, Tuple[int, ...]]) -> list:
    """Problems an engine would hit loading `tensors` (name -> shape) with `config`."""
    problems = [f"config.json lacks {k!r}" for k in loader.config_keys if k not in config]
    if problems:
        return problems
    params = loader.params(config)
    loaded = set()
    for name, shape in sorted(tensors.items()):
        target = loader.rename(name)
        if target is None:
            continue
        if target not in params:
            problems.append(f"{name} -> {target}: no such parameter")
        elif tuple(shape) != tuple(params[target]):
            problems.append(f"{name} -> {target}: shape {tuple(shape)}, expected {params[target]}")
        loaded.add(target)
    missing = sorted(set(params) - loaded - set(loader.from_target))
    problems += [f"{p} is never loaded" for p in missing]
    return problems
