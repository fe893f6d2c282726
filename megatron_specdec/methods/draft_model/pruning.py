"""Structured depth pruning of a GPT: a smaller draft model of the same vocabulary, made the
way Minitron prunes depth (keep a subset of the layers, embeddings and head unchanged), with
ShortGPT's block influence as the measured importance.

Importance of layer i = mean over tokens of 1 - cos(x_i, y_i), where x_i and y_i are the
residual stream entering and leaving it: a layer whose output nearly equals its input changes
little and is the cheapest to drop. Scores are measured on real text (a few hundred tokens
of conversations); the kept layers keep their order. The result is a normal checkpoint
(methods/draft_model/proposer.py drafts with it; megatron_to_hf exports it).

One process at TP=1, PP=1: scoring reads every layer's input and output, and the models this
is for (drafts of a small target) fit one process; the checkpoint it writes loads at any
TP/PP, as every checkpoint does.
"""

import torch


@torch.no_grad()
def layer_importance(model, sequences, vocab_size: int) -> torch.Tensor:
    """Block influence [num_layers] of a whole (TP=1, PP=1) GPTModel over `sequences` (lists
    of token ids), token-weighted."""
    from megatron_specdec.distributed import device
    from megatron_specdec.inference.generation import StageRunner

    layers = len(model.decoder.layers)
    total, count = torch.zeros(layers, dtype=torch.float64), 0
    for ids in sequences:
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=device())
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        runner = StageRunner(model, 1, tokens.shape[1], vocab_size, capture_ids=range(layers))
        runner.step(tokens, last_only=True)
        stream = [model.embedding(input_ids=tokens, position_ids=positions)]
        stream += [runner.captured[i] for i in range(layers)]
        for i in range(layers):
            cos = torch.nn.functional.cosine_similarity(stream[i].double(),
                                                        stream[i + 1].double(), dim=-1)
            total[i] += (1 - cos).sum().cpu()
        count += tokens.shape[1]
    return total / count


def layers_to_keep(importance: torch.Tensor, num_layers: int) -> list:
    """The `num_layers` most important layer indices, in model order."""
    if not 1 <= num_layers <= importance.numel():
        raise ValueError(f"--num-layers {num_layers}: the model has {importance.numel()} "
                         f"layers; keep between 1 and all of them")
    return sorted(importance.topk(num_layers).indices.tolist())


def prune(model, hf_config, keep: list):
    """(a GPTModel of the layers `keep` of the whole `model`, in order, with its embedding,
    final norm and head; the matching HF config)."""
    from megatron_specdec.models.provider import build_model

    config = type(hf_config).from_dict({**hf_config.to_dict(), "num_hidden_layers": len(keep)})
    pruned = build_model(config, dtype=model.config.params_dtype, padding=model.padding)
    renumber = {old: new for new, old in enumerate(keep)}
    state = {}
    for name, value in model.state_dict().items():
        if name.startswith("decoder.layers."):
            layer, rest = name[len("decoder.layers."):].split(".", 1)
            if int(layer) not in renumber:
                continue
            name = f"decoder.layers.{renumber[int(layer)]}.{rest}"
        state[name] = value
    pruned.load_state_dict(state)
    return pruned.eval(), config


def conversation_sample(paths, tokenizer, num_tokens: int, max_length: int = 256) -> list:
    """Token id lists of the first conversations of jsonl `paths` (chat template), each cut
    at `max_length`, until they hold `num_tokens` tokens."""
    from megatron_specdec.data.conversations import read_conversations, tokenize_conversation

    out, held = [], 0
    for row in read_conversations(paths):
        ids = tokenize_conversation(tokenizer, row["conversations"], max_length).input_ids
        out.append(ids[: num_tokens - held])
        held += len(out[-1])
        if held >= num_tokens:
            return out
    if not out:
        raise ValueError(f"--data {paths}: no conversations")
    return out
