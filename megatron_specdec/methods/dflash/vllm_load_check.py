"""Run by the vLLM env's interpreter (it imports vllm, not megatron_specdec): build vLLM's own
DFlash draft class for `base_dir` + `draft_dir` and run its `load_weights` on the export.

    python vllm_load_check.py BASE_DIR DRAFT_DIR OUT_JSON

Every draft parameter starts as NaN; after loading, a parameter still holding a NaN was not
loaded (vLLM's loader does not complain about missing names). Each loaded parameter is also
compared with the tensors it was built from (q/k/v and gate/up stacked as vLLM stacks them),
and every tensor the export holds must have been handed to a parameter. `embed_tokens` and
`lm_head` are the base's (vLLM's runner shares them after this load), so they are reported,
not required.
"""

import json
import sys


def main(base_dir, draft_dir, out_json):
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.utils.network_utils import get_open_port

    args = EngineArgs(model=base_dir, dtype="float32", max_model_len=512, enforce_eager=True,
                      speculative_config={"method": "dflash", "model": draft_dir,
                                          "num_speculative_tokens": 7})
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1, 1)
        model = DFlashQwen3ForCausalLM(vllm_config=vllm_config)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        tensors = load_file(f"{draft_dir}/model.safetensors")
        handed = []

        def stream():
            for name, t in tensors.items():
                handed.append(name)
                yield name, t

        model.load_weights(stream())
    params = dict(model.named_parameters())
    shared = ("model.embed_tokens.weight", "lm_head.weight")
    unloaded = sorted(n for n, p in params.items() if torch.isnan(p).any() and n not in shared)
    mask = torch.load(f"{draft_dir}/mask_embedding.pt", weights_only=True)

    def expected(name):
        n = name.removeprefix("model.")
        if n.endswith("qkv_proj.weight"):
            p = n.removesuffix("qkv_proj.weight")
            return torch.cat([tensors[p + s + "_proj.weight"] for s in "qkv"])
        if n.endswith("gate_up_proj.weight"):
            p = n.removesuffix("gate_up_proj.weight")
            return torch.cat([tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"]])
        if n == "mask_embedding":
            return mask["embedding"]
        return tensors.get(n)

    mismatched = []
    for name, p in params.items():
        if name in shared or name in unloaded:
            continue
        want = expected(name)
        if want is None or tuple(want.shape) != tuple(p.shape) or not torch.equal(want.to(p.dtype), p.data):
            mismatched.append(name)
    result = {
        "class": type(model).__name__, "parameters": sorted(params), "unloaded": unloaded,
        "mismatched": mismatched, "tensors": sorted(tensors), "handed": sorted(set(handed)),
        "shared_from_base": [n for n in shared if n in params],
        "separate_mask_embedding": bool(model.model.has_separate_mask_embedding),
        "causal": model.get_draft_attn_causal(),
    }
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
