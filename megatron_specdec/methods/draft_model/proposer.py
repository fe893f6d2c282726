"""Draft-target speculation: a separate, smaller Megatron GPT of the target's vocabulary
drafts the chain (TensorRT-LLM's draft_tokens_external, vLLM's draft model, transformers'
`assistant_model=`).

The draft runs replicated on every rank of the target's last pipeline stage, whole (TP=1,
PP=1), in its own process groups of one rank each. A draft is small by design: split over
TP it would add two all-reduces per layer per drafted token, latency that a small model's
matmuls cannot hide; replicated it costs one copy of its weights per last-stage rank and no
communication. Every replica computes the same drafts from the same inputs (same weights,
same kernels, and the seeded sampler every model-parallel rank shares), so the TP ranks of
the last stage agree without a message. Its checkpoint, saved at any TP/PP, is read as
global tensors.

Its KV cache is a generation.StageRunner over its own DecodeCache (a length per row). The
cache holds each row's verified tokens but the newest; a round feeds what each row has not
seen (a left-padded chunk), then one forward per further draft. Drafts that the target then
accepts stay in the cache; the rest are rewound, so a fully rejected round costs the draft
nothing to undo.
"""

import json
from pathlib import Path

import torch
from torch import Tensor

from megatron_specdec.inference.draft_policy import draft_chain


GROUPS = ("tp", "pp", "mp", "cp", "tp_cp", "embd", "pos_embd", "dp", "dp_cp")


def own_process_groups():
    """A ProcessGroupCollection whose groups hold this rank alone. Collective over the world
    (every rank creates every group)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    alone, _ = dist.new_subgroups(group_size=1)
    groups = ProcessGroupCollection()
    for name in GROUPS:
        setattr(groups, name, alone)
    return groups


def _tokenizer_vocab(tokenizer_dir):
    """The token -> id map of a checkpoint's tokenizer directory, None when it has none."""
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir)).get_vocab()


def check_draft_checkpoint(path, vocab_size: int, tokenizer_dir=None) -> dict:
    """The metadata of a draft-model checkpoint, refused with the reason when it is not a
    plain GPT checkpoint, or when its vocabulary (size, or tokenizer where both have one)
    differs from the target's (`vocab_size`, `tokenizer_dir`)."""
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.models import families

    path = Path(path)
    if (path / "config.json").is_file() and not (path / checkpoint.META_FILE).is_file():
        architectures = json.loads((path / "config.json").read_text()).get("architectures")
        raise checkpoint.CheckpointError(
            f"--draft-model {path}: an HF directory ({architectures}); a draft model is a "
            f"megatron_specdec GPT checkpoint (checkpoint_tools/hf_to_megatron.py imports one)")
    meta = checkpoint.read_meta(path)
    if "draft" in meta:
        raise checkpoint.CheckpointError(
            f"--draft-model {path}: a speculative checkpoint (its {meta['draft']['algo']} draft "
            f"module drafts with --drafter {meta['draft']['algo']}); a draft model is a plain "
            f"GPT checkpoint")
    config = checkpoint.hf_config_from_meta(meta)
    try:
        families.family_of(config)
    except families.UnsupportedModelError as e:
        raise checkpoint.CheckpointError(f"--draft-model {path}: not a GPT: {e}") from None
    if config.vocab_size != vocab_size:
        raise ValueError(f"--draft-model {path}: vocab_size {config.vocab_size} in its "
                         f"hf_config; the target's is {vocab_size}: draft and target need "
                         f"one vocabulary")
    ours = _tokenizer_vocab(path / checkpoint.TOKENIZER_DIR)
    theirs = _tokenizer_vocab(tokenizer_dir)
    if ours is not None and theirs is not None and ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise ValueError(f"--draft-model {path}: its tokenizer ({path / checkpoint.TOKENIZER_DIR}) "
                         f"is not the target's ({tokenizer_dir}); entries that differ: {differ}")
    return meta


def load_draft_model(path, vocab_size: int, tokenizer_dir=None, dtype=None):
    """The draft GPTModel of checkpoint `path` (in `dtype`, default its saved one), whole on
    this rank in its own groups (module notes), after check_draft_checkpoint; frozen, for
    drafting (the trainer unfreezes it). Collective over the world: the checkpoint reader is."""
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.distributed import device
    from megatron_specdec.models.provider import make_model_provider

    meta = check_draft_checkpoint(path, vocab_size, tokenizer_dir)
    provider = make_model_provider(
        checkpoint.hf_config_from_meta(meta),
        dtype=dtype or checkpoint.dtype_from_name(meta["dtype"]),
        transformer_impl=meta["transformer_impl"], padding=meta["padding"],
        pg_collection=own_process_groups())
    model = provider(pre_process=True, post_process=True).to(device())
    # Every replica reads whole tensors, so reads overlap: skip the access-integrity check.
    state = checkpoint.load_sharded(model.sharded_state_dict(), path,
                                    validate_access_integrity=False)
    checkpoint.load_state(model, state, path)
    return model.requires_grad_(False).eval()


class DraftModelDrafter:
    def __init__(self, model, vocab_size: int):
        """model: a draft GPTModel from load_draft_model; vocab_size: the shared unpadded
        vocabulary."""
        self.model = model
        self.vocab_size = vocab_size
        self.runner = None
        self.unseen = None  # [b, u] verified tokens not in the cache yet, left-padded
        self.unseen_counts = None  # [b] real ones per row (the newest last)
        self.chain = None  # [b, f] drafts of the current round in the cache after the verified

    def start(self, prompt: Tensor, lengths: Tensor, pending: Tensor, out, max_length: int):
        """After the target's prefill: the draft reads the prompt; pending is its next token."""
        from megatron_specdec.inference.generation import StageRunner

        self.runner = StageRunner(self.model, prompt.shape[0], max_length, self.vocab_size)
        self.runner.step(prompt, last_only=True, counts=lengths)
        self.unseen, self.unseen_counts = pending, torch.ones_like(lengths)
        self.chain = pending[:, :0]

    def _chain(self, k: int, policy, pick):
        """Up to k chained drafts (draft_policy.draft_chain; pick reads logits [b, V], take()
        gives tokens [b]). The fed drafts stay in the cache until `accept`."""
        logits = self.runner.step(self.unseen, last_only=True, counts=self.unseen_counts)[:, -1]
        self.unseen = self.unseen[:, :0]
        self.unseen_counts = torch.zeros_like(self.unseen_counts)

        def advance(tokens):
            logits = self.runner.step(tokens[:, None], last_only=True)[:, -1]
            self.chain = torch.cat([self.chain, tokens[:, None]], dim=1)
            return logits

        return draft_chain(k, policy, logits, advance, pick)

    def propose(self, k: int, policy=None):
        """Up to k greedy draft tokens [b, n] (n may be 0) and the count [b] each row keeps."""
        confident = policy is not None and policy.threshold is not None

        def pick(logits):
            confidence = (logits.double().softmax(-1).max(-1).values if confident
                          else logits.new_ones(logits.shape[0], dtype=torch.float64))
            return confidence, lambda: (logits.argmax(-1), None)

        drafts, _, counts = self._chain(k, policy, pick)
        return (torch.stack(drafts, dim=1) if drafts else self.chain[:, :0]), counts

    def propose_sampled(self, k: int, policy, sampling, rng):
        """Up to k tokens sampled from the draft's distribution (the target's temperature,
        top-k, top-p), the counts kept, and those distributions, ([b, n], [b], [b, n, V]
        float64), for lossless verification with draft probabilities."""
        from megatron_specdec.acceptance.reference import target_probs

        def pick(logits):
            q = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            return q.max(-1).values, lambda: (torch.multinomial(q, 1, generator=rng)[:, 0], q)

        drafts, probs, counts = self._chain(k, policy, pick)
        if not drafts:
            return self.chain[:, :0], counts, None
        return torch.stack(drafts, dim=1), counts, torch.stack(probs, dim=1)

    def keep_rows(self, rows: Tensor):
        """Keep only the batch rows `rows` (ascending)."""
        self.runner.keep_rows(rows)
        rows = rows.to(self.unseen.device)
        self.unseen, self.chain = self.unseen[rows], self.chain[rows]
        self.unseen_counts = self.unseen_counts[rows.to(self.unseen_counts.device)]

    def accept(self, tokens: Tensor, counts: Tensor, out):
        """The target kept tokens [b, s] (the last counts[b] of row b) after the newest token
        the draft knew: cached drafts that match them stay (but the newest kept token, whose
        logits the next round needs), the rest are rewound; the others are fed next round."""
        fed, s = self.chain.shape[1], tokens.shape[1]
        j = torch.arange(s, device=tokens.device)
        # Row b's kept tokens, first at column 0 (rolled out of the left padding).
        first = tokens.gather(1, (j + s - counts[:, None]) % s)
        n = min(fed, s)
        match = (self.chain[:, :n] == first[:, :n]) & (j[:n] < counts[:, None] - 1)
        kept = match.long().cumprod(1).sum(1)
        self.runner.rewind(fed - kept)
        # Unseen: row b's kept tokens from kept[b] on, still left-padded.
        self.unseen, self.unseen_counts = tokens, counts - kept
        self.chain = self.chain[:, :0]


def make_proposer(model, options):
    """This stage's proposer over the draft GPT of `options.draft_model` (None before the
    last stage). Collective over the world: the draft checkpoint is read on every rank."""
    from megatron.core import parallel_state as ps

    if options.draft_model is None:
        raise ValueError("--draft-model goes with --drafter draft_model, and it needs one")
    # In the target's dtype, as vLLM runs a draft model (a bf16 draft beside an fp32
    # target runs the slower bf16 kernels on the 2-core CPU: a SmolLM2 step 52 ms vs 39).
    draft = load_draft_model(options.draft_model, model.vocab_size,
                             dtype=model.base.config.params_dtype)
    return DraftModelDrafter(draft, model.vocab_size) if ps.is_pipeline_last_stage() else None
