"""Import a Hugging Face EAGLE3 draft (LlamaForCausalLMEagle3 layout, as published by EAGLE,
SpecForge and ModelOpt or written by export_draft.py) into a Megatron speculative checkpoint
at any TP/PP, on top of a base (or speculative) checkpoint, to continue training.

    python checkpoint_tools/import_draft.py --draft runs/hf/eagle3 \\
        --model runs/ckpt/smollm2 --out runs/ckpt/smollm2_eagle3 --tp 2

The draft must fit the base (hidden size, heads, MLP width, vocabulary, norm epsilon, rope);
everything is checked before anything is written. Under torchrun (nproc = tp * pp) it uses
that group; otherwise it starts tp * pp local processes itself.
"""

import logging
import sys
import time

from megatron_specdec.cli.common import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__,
                       renamed={"--model_path": "--model", "--export_dir": "--out"})
    p.add_argument("--draft", required=True, help="HF EAGLE3 draft directory")
    p.add_argument("--model", required=True,
                   help="base Megatron checkpoint (a speculative one: its draft is replaced)")
    p.add_argument("--out", required=True, help="speculative checkpoint directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to save at (default 1)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline parallel size to save at (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec.methods.eagle3.hf_import import import_eagle3

    start = time.time()
    import_eagle3(args.draft, args.model, args.out, tp=args.tp, pp=args.pp,
                  overwrite=args.overwrite)
    logging.getLogger("import_draft").info("wrote %s in %.1f s", args.out,
                                           time.time() - start)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
