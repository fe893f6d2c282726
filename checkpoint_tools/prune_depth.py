"""Depth-prune a GPT into a draft model of the same vocabulary: keep the --num-layers layers of
highest measured importance (block influence on --data conversations; see
megatron_specdec/methods/draft_model/pruning.py) and write a normal checkpoint (tokenizer included) that
`--drafter draft_model --draft-model OUT` drafts with and megatron_to_hf exports.

    python checkpoint_tools/prune_depth.py --model default --num-layers 10 \\
        --data data/smollm2_regen.jsonl.gz --out runs/draft_models/smollm2_10l

--model: a megatron_specdec checkpoint, an HF model directory, or 'default' (the embedded
SmolLM2). One process (TP=1, PP=1); the output loads at any layout.
"""

import json
import logging
import sys

from megatron_specdec.cli.common import ArgumentParser, run_cli

log = logging.getLogger("prune_depth")


def build_parser():
    p = ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint, HF directory or 'default'")
    p.add_argument("--num-layers", type=int, required=True, help="layers to keep")
    p.add_argument("--data", nargs="+", required=True,
                   help="conversation jsonl(.gz) files to measure importance on")
    p.add_argument("--num-tokens", type=int, default=512,
                   help="tokens of --data to measure on (default 512)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.methods.draft_model import pruning as depth_pruning
    from megatron_specdec import distributed
    from megatron_specdec.data import load_tokenizer
    from megatron_specdec.loading.hf_conversion import base_meta
    from megatron_specdec.loading.source import load_model
    from megatron_specdec.models.provider import resolve_transformer_impl

    checkpoint.check_output_dir(args.out, args.overwrite, "--out")
    distributed.initialize(1, 1)
    loaded = load_model(args.model, with_draft=False)
    model, config, tokenizer_dir = loaded.model, loaded.hf_config, loaded.tokenizer_dir
    tokenizer = load_tokenizer(str(tokenizer_dir))
    sample = depth_pruning.conversation_sample(args.data, tokenizer, args.num_tokens)
    importance = depth_pruning.layer_importance(model, sample, config.vocab_size)
    keep = depth_pruning.layers_to_keep(importance, args.num_layers)
    pruned, pruned_config = depth_pruning.prune(model, config, keep)
    meta = base_meta(pruned_config, pruned, pruned.config.params_dtype,
                     resolve_transformer_impl("auto"))
    meta["pruned_from"] = {"model": str(args.model), "kept_layers": keep,
                           "importance": [round(float(x), 6) for x in importance],
                           "measured_on": f"{sum(map(len, sample))} tokens of {args.data}"}
    checkpoint.save_checkpoint(pruned, args.out, meta, tokenizer_dir=tokenizer_dir,
                               overwrite=args.overwrite)
    print(json.dumps(meta["pruned_from"], indent=2))
    log.info("wrote %s: %d of %d layers", args.out, len(keep), config.num_hidden_layers)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
