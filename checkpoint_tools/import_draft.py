"""Import a Hugging Face draft into a Megatron speculative checkpoint at any TP/PP, on top of
a base (or speculative) checkpoint, to continue training or to generate: an EAGLE3 draft
(LlamaForCausalLMEagle3 layout, as published by EAGLE, SpecForge and ModelOpt or written by
export_draft.py) or, with --method dflash, a DFlash block draft (vLLM's DFlashDraftModel).

    python checkpoint_tools/import_draft.py --draft runs/hf/eagle3 \\
        --model runs/ckpt/smollm2 --out runs/ckpt/smollm2_eagle3 --tp 2
    python checkpoint_tools/import_draft.py --method dflash --draft runs/hf/dflash \\
        --model runs/ckpt/smollm2 --out runs/ckpt/smollm2_dflash
    python checkpoint_tools/import_draft.py --draft models/eagle3_smollm2 --model runs/base \\
        --out runs/peagle_start --parallel-drafting data/smollm2_regen_general.jsonl.gz

The draft must fit the base (hidden size, heads, MLP width, vocabulary, norm epsilon, rope);
everything is checked before anything is written. Under torchrun (nproc = tp * pp) it uses
that group; otherwise it starts tp * pp local processes itself.
"""

import logging
import sys
import time
from pathlib import Path

from megatron_specdec.cli.common import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__,
                       renamed={"--model_path": "--model", "--export_dir": "--out"})
    p.add_argument("--draft", required=True, help="HF draft directory")
    p.add_argument("--method", default="eagle3",
                   help="the draft's method: eagle3 (default) or dflash; any registered method "
                        "with an HF import")
    p.add_argument("--model", required=True,
                   help="base Megatron checkpoint (a speculative one: its draft is replaced)")
    p.add_argument("--out", required=True, help="speculative checkpoint directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to save at (default 1)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline parallel size to save at (default 1)")
    p.add_argument("--parallel-drafting", nargs="+", default=None, metavar="DATA",
                   help="eagle3 only: import a chain draft as the start of a parallel-drafting "
                        "(P-EAGLE) draft to train on; its mask_hidden starts from the base's "
                        "states over these conversations (jsonl; the first 32)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="with --parallel-drafting: this many draft layers, those added after "
                        "the chain draft's starting as the identity")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec import registry

    method = registry.get(registry.canonical(args.method))
    if method.import_hf is None:
        with_import = [n for n in registry.names() if registry.get(n).import_hf is not None]
        raise ValueError(f"--method {args.method}: has no HF import; expected one of: "
                         f"{', '.join(with_import)}")
    options = {}
    if args.parallel_drafting or args.draft_layers is not None:
        from megatron_specdec.checkpointing.checkpoint import TOKENIZER_DIR
        from megatron_specdec.methods.eagle3.mask_init import conversation_ids

        if method.name != "eagle3":
            raise ValueError(f"--parallel-drafting, --draft-layers: eagle3 options; --method "
                             f"is {method.name}")
        sequences = None
        if args.parallel_drafting:
            sequences = conversation_ids(args.parallel_drafting, Path(args.model) / TOKENIZER_DIR)
        # import_eagle3 refuses --draft-layers without --parallel-drafting
        options = {"parallel_drafting": sequences, "draft_layers": args.draft_layers}
    start = time.time()
    method.import_hf(args.draft, args.model, args.out, tp=args.tp, pp=args.pp,
                     overwrite=args.overwrite, **options)
    logging.getLogger("import_draft").info("wrote %s in %.1f s", args.out,
                                           time.time() - start)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
