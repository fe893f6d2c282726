"""A fingerprint of the frozen base a draft is trained over, saved with every training
checkpoint and compared on resume: a different model at the same path, or the same one in
another dtype, is refused naming what differs instead of resuming silently.

It holds the base's HF config, its dtype, and for a few tensors (embedding, output layer,
final norm, every layer's attention output projection) four float64 sums over the global
tensor: element count, sum|x|, sum x^2 and sum over rows r of (r+1)*sum|x_r| (rows swapped
change it). Each rank adds the main replicas of its shards and one all-reduce makes them
global, so the value does not depend on the TP/PP/DP layout beyond float64 rounding (~1e-12
relative: every term is positive). They are compared at a relative 1e-6, far above that
rounding and far below what other weights change (for n random values sum|x| moves by
~1/sqrt(n), 1e-2 at n = 16K).
"""

import json

import torch
import torch.distributed as dist

from megatron_specdec.distributed import device

TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight",
           "decoder.final_layernorm.weight", "decoder.layers.self_attention.linear_proj.weight")
SUMS = ("elements", "sum|x|", "sum x^2", "row-weighted sum|x|")
RTOL = 1e-6
# Bookkeeping keys of an HF config that say nothing about the weights' meaning.
_IGNORED_CONFIG = ("transformers_version", "torch_dtype", "dtype", "architectures")


def _sums(tensor, block: int = 4096) -> torch.Tensor:
    """SUMS of one ShardedTensor's local data, rows numbered globally (in row blocks, so no
    float64 copy of a whole embedding is made)."""
    data = tensor.data.detach()
    data = data.reshape(data.shape[0], -1)
    axis = tensor.prepend_axis_num
    first = 0  # global number of the first local row, counting the prepended (layer) axes
    for offset, size in zip(tensor.global_offset[:axis + 1], tensor.global_shape[:axis + 1]):
        first = first * size + offset
    out = torch.zeros(len(SUMS), dtype=torch.float64, device=data.device)
    out[0] = data.numel()
    for start in range(0, data.shape[0], block):
        rows = data[start:start + block].abs().double()
        ids = torch.arange(first + start + 1, first + start + 1 + rows.shape[0],
                           dtype=torch.float64, device=rows.device)
        out[1:] += torch.stack([rows.sum(), rows.pow(2).sum(), (rows.sum(1) * ids).sum()])
    return out


def fingerprint(base, hf_config: dict, dtype: str) -> dict:
    """Collectively fingerprint this process group's base GPTModel (every rank calls)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    sums = torch.zeros(len(TENSORS), len(SUMS), dtype=torch.float64, device=device())
    for t in base.sharded_state_dict().values():  # one entry per layer of a stacked key
        if (isinstance(t, ShardedTensor) and t.key in TENSORS
                and is_main_replica(t.replica_id)):
            sums[TENSORS.index(t.key)] += _sums(t).to(sums.device)
    dist.all_reduce(sums)
    config = json.loads(json.dumps({k: v for k, v in hf_config.items()
                                    if not k.startswith("_") and k not in _IGNORED_CONFIG}))
    return {"config": config, "dtype": dtype,
            "tensors": {key: row.tolist() for key, row in zip(TENSORS, sums.cpu())}}


def differences(saved: dict, mine: dict) -> list:
    """What differs between two fingerprints, one readable item per config key or tensor."""
    out = [f"config {k} (saved {saved['config'].get(k)!r}, now {mine['config'].get(k)!r})"
           for k in sorted(set(saved["config"]) | set(mine["config"]))
           if saved["config"].get(k) != mine["config"].get(k)]
    if saved["dtype"] != mine["dtype"]:
        out.append(f"dtype (saved {saved['dtype']}, now {mine['dtype']})")
    for key in TENSORS:
        a, b = saved["tensors"].get(key), mine["tensors"].get(key)
        for name, x, y in zip(SUMS, a or [], b or []):
            if abs(x - y) > RTOL * max(abs(x), abs(y)):
                out.append(f"tensor {key} ({name} saved {x:.9g}, now {y:.9g})")
                break
    return out
