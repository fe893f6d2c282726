"""Batched greedy generation from a Megatron GPTModel with a static KV cache, at any TP/PP.

Every rank of the model-parallel group runs the same loop. Pipeline stages hand hidden states
to the next stage with point-to-point sends; the last stage gathers the vocab-parallel logits
(megatron-core insists on that in inference) and broadcasts the chosen tokens back to all stages. Prompts are left-padded; pad keys are
masked out, and RoPE is relative, so a row's result does not depend on its padding.
"""

import torch
import torch.distributed as dist


class StageRunner:
    """One forward of this pipeline stage over a static KV cache: `step(tokens)` appends
    `tokens` [b, s] to the cache and returns full-vocabulary logits [b, s, V] on the last
    stage (None elsewhere). `rewind(n)` drops the last n cached positions."""

    def __init__(self, model, batch_size: int, max_length: int, vocab_size: int):
        from megatron.core import parallel_state as ps
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model = model
        self.vocab_size = vocab_size
        self.context = StaticInferenceContext(batch_size, max_length)
        self.context.materialize_only_last_token_logits = False
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
        self.next_rank = ps.get_pipeline_model_parallel_next_rank()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.hidden_size = model.config.hidden_size
        self.dtype = model.config.params_dtype
        self.key_padding = torch.zeros(batch_size, 0, dtype=torch.bool)

    @property
    def length(self) -> int:
        return self.context.sequence_len_offset

    def set_padding(self, key_padding: torch.Tensor):
        """[b, prompt_len] True where a prompt position is left padding."""
        self.key_padding = key_padding

    def _mask(self, s: int, device) -> torch.Tensor:
        """[b, 1, s, offset + s] True where attention is not allowed (future or padding)."""
        offset = self.length
        total = offset + s
        q = torch.arange(offset, total, device=device).unsqueeze(1)
        k = torch.arange(total, device=device).unsqueeze(0)
        future = (k > q).unsqueeze(0)
        pad = torch.zeros(self.key_padding.shape[0], total, dtype=torch.bool, device=device)
        pad[:, : self.key_padding.shape[1]] = self.key_padding[:, :total].to(device)
        return (future | pad[:, None, :]).unsqueeze(1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor):
        b, s = tokens.shape
        device = tokens.device
        if not self.first:
            hidden = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=device)
            dist.recv(hidden, src=self.prev_rank)
            self.model.set_input_tensor(hidden)
        positions = torch.arange(self.length, self.length + s, device=device).expand(b, s)
        out = self.model(
            tokens, positions, self._mask(s, device), inference_context=self.context,
            runtime_gather_output=True,
        )
        self.context.sequence_len_offset += s
        if not self.last:
            dist.send(out.contiguous(), dst=self.next_rank)
            return None
        return out[..., : self.vocab_size].float()

    def rewind(self, n: int):
        self.context.sequence_len_offset -= n

    def broadcast_from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Give every stage the last stage's `tensor` (same shape and dtype on all ranks)."""
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(tensor, src=self.last_rank, group=self.pp_group)
        return tensor


def left_pad(prompts, pad_id: int, device=None):
    """[b, L] tokens and [b, L] padding flags for a ragged batch of prompts."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    length = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=device)
    padding = torch.ones(len(prompts), length, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p):] = torch.as_tensor(p, dtype=torch.long)
        padding[i, length - len(p):] = False
    return tokens, padding


@torch.no_grad()
def greedy_generate(model, prompts, max_new_tokens: int, vocab_size: int, eos_ids=()):
    """Greedy continuations of `prompts` (lists of token ids), stopping a row at any id in
    `eos_ids` (not included in its result) or after `max_new_tokens`. `vocab_size` is the
    unpadded vocabulary. All model-parallel ranks call this with the same prompts; every
    rank returns the result."""
    from megatron_specdec.distributed import device

    tokens, padding = left_pad(prompts, 0, device())
    batch = tokens.shape[0]
    runner = StageRunner(model, batch, tokens.shape[1] + max_new_tokens, vocab_size)
    runner.set_padding(padding)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=tokens.device)
    done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    results = [[] for _ in range(batch)]
    step_input = tokens
    for _ in range(max_new_tokens):
        logits = runner.step(step_input)
        next_tokens = torch.zeros(batch, dtype=torch.long, device=tokens.device)
        if runner.last:
            next_tokens = logits[:, -1].argmax(-1)
        runner.broadcast_from_last(next_tokens)
        finished = torch.isin(next_tokens, eos) | done
        for i in range(batch):
            if not finished[i]:
                results[i].append(int(next_tokens[i]))
        done = finished
        if bool(done.all()):
            break
        step_input = next_tokens.unsqueeze(1)
    return results
