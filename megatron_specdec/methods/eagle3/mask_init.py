"""The starting `mask_hidden` of a parallel-drafting EAGLE3 draft made from a chain draft.

Measured on the shipped SmolLM2 draft: with a random mask_hidden every attention head of the
mask positions sinks onto the first positions (or onto the mask keys) and the mask positions
learn one token for every context; with the mean of the base's aux states over real
conversations their heads attend to the newest real positions as a real position's do. The
mean's scale is cut (`SCALE`) because the mask positions' residual stream starts at
fc(mask_hidden): at full scale that constant outweighs what attention brings and predicts one
token everywhere; the query, behind hidden_norm, does not see the scale.
"""

import torch

SCALE = 0.01
CONVERSATIONS = 32
MAX_LENGTH = 512


def conversation_ids(data_paths, tokenizer_dir) -> list:
    """Token ids of the first CONVERSATIONS conversations of `data_paths` (chat template, at
    most MAX_LENGTH tokens each)."""
    from megatron_specdec.data import load_tokenizer, read_conversations, tokenize_conversation

    rows = read_conversations(list(data_paths))[:CONVERSATIONS]
    if not rows:
        raise ValueError(f"{', '.join(map(str, data_paths))}: no conversation to start "
                         f"mask_hidden from")
    tokenizer = load_tokenizer(str(tokenizer_dir))
    return [tokenize_conversation(tokenizer, row["conversations"], MAX_LENGTH).input_ids
            for row in rows]


@torch.no_grad()
def start_mask_hidden(model, sequences):
    """This stage's draft mask_hidden := SCALE x the mean of the base's aux states over every
    position of `sequences` (token id lists); `model` holds the whole base (one stage)."""
    device = next(model.base.parameters()).device
    total, count = 0.0, 0
    for ids in sequences:
        aux = torch.cat(model.run_base(torch.tensor([ids], device=device)).aux, dim=-1)
        total = total + aux[:, 0].double().sum(0)
        count += aux.shape[0]
    mean = (total / count)[None]
    model.draft.mask_hidden.copy_((SCALE * mean).to(model.draft.mask_hidden.dtype))
