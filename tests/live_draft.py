"""An EAGLE3 draft for SmolLM2 that an engine accepts tokens from, fitted in one pass, no training.

An untrained draft serves at AL 1.0, so wrong aux layers would not change what an engine
measures. This one is a linear EAGLE: the attention and MLP branches are zeroed
(o_proj, down_proj), so the draft's hidden state is fc(aux states), and fc is a ridge
regression from the aux states at position t (the base's residual stream after layers
1, 14, 26 = transformers hidden_states[2, 15, 27]) to the direction of the base's final hidden
state at t + 1, which the base's final norm and lm_head rows (copied into the draft) turn into
the token at t + 2: what the draft's first step predicts. vLLM accepts 16 of its 79 drafts
on the suite's 3 prompts (AL 1.20 at k = 3), and fewer than half as many when fed other aux
layers. The ridge is light: with a heavy one (0.1) acceptance did not move with the layers.
"""

import gzip
import json
from dataclasses import dataclass

import torch

FIT_LAYERS = (1, 14, 26)  # output-of-layer ids, the SmolLM2 default


def _conversation_ids(tokenizer, data_file, rows: int, max_len: int):
    with gzip.open(data_file, "rt") as f:
        lines = [json.loads(line) for _, line in zip(range(rows), f)]
    return [tokenizer.apply_chat_template(r["conversations"], tokenize=True,
                                          return_dict=False)[:max_len] for r in lines]


@torch.no_grad()
def _fit(model, sequences, ridge: float):
    """fc [h, 3h] mapping aux states at t to the unit-RMS final hidden state at t + 1."""
    xs, ys = [], []
    for ids in sequences:
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i + 1][0] for i in FIT_LAYERS], dim=-1)
        final = states[-1][0] / model.model.norm.weight  # undo the norm's gain: unit RMS
        xs.append(aux[:-1])
        ys.append(final[1:])
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    gram = x.T @ x
    gram += ridge * gram.diagonal().mean() * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(gram, x.T @ y).T.float()


def draft_vocab(sequences, size: int, vocab_size: int):
    """(d2t, t2d): the `size` most frequent ids of `sequences`, sorted by id."""
    counts = torch.bincount(torch.tensor([t for s in sequences for t in s]),
                            minlength=vocab_size).double()
    counts += torch.linspace(1e-3, 0, vocab_size, dtype=torch.float64)  # ties: lower id first
    ids = counts.topk(size).indices.sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


@dataclass
class LiveFit:
    """What every live draft of one base shares: fc, the draft vocabulary and the base's
    final norm and lm_head rows."""
    fc: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor


def fit(base_dir, data_file, draft_vocab_size=2048, rows=24, max_len=256, ridge=1e-4):
    """Fit on the first `rows` conversations of `data_file` (the base's own answers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    sequences = _conversation_ids(AutoTokenizer.from_pretrained(base_dir), data_file, rows,
                                  max_len)
    d2t, t2d = draft_vocab(sequences, draft_vocab_size, model.config.vocab_size)
    return LiveFit(_fit(model, sequences, ridge), d2t, t2d,
                   model.model.norm.weight.detach().clone(),
                   model.lm_head.weight.detach()[t2d].clone())


def write(live: LiveFit, base_dir, out_dir, num_layers=1):
    """The HF EAGLE3 draft directory (config.json + model.safetensors) of `num_layers` layers
    for the HF base in `base_dir`."""
    from transformers import AutoConfig

    from megatron_specdec import registry
    from megatron_specdec.methods.eagle3 import hf_export as eagle3_hf

    base = AutoConfig.from_pretrained(base_dir)
    cfg = registry.parse_config("eagle3", {"eagle_num_layers": num_layers,
                                       "draft_vocab_size": live.d2t.numel(),
                                       "eagle_aux_hidden_state_layer_ids": list(FIT_LAYERS)},
                            base.num_hidden_layers, base.vocab_size)
    config = eagle3_hf.hf_config(base, cfg, "float32")
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in eagle3_hf.tensor_shapes(config).items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros(shape)  # the branches are off: hidden = fc(aux)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        elif name.endswith("proj.weight"):
            tensors[name] = torch.randn(shape, generator=generator) * 0.02
    tensors.update({"fc.weight": live.fc, "d2t": live.d2t, "t2d": live.t2d,
                    "norm.weight": live.norm, "lm_head.weight": live.lm_head})
    out_dir.mkdir(parents=True, exist_ok=True)
    eagle3_hf.write(out_dir, config, {k: v.contiguous() for k, v in tensors.items()})
    return out_dir
