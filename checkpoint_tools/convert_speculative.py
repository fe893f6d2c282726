"""Add an EAGLE3 or Medusa draft module to a Megatron base checkpoint.

    python checkpoint_tools/convert_speculative.py --model runs/ckpt/smollm2 \\
        --algo eagle3 --out runs/ckpt/smollm2_eagle3 \\
        --draft-vocab-size 8192 --calibration-data data/regenerated.jsonl --tp 2

Writes a new dist checkpoint holding the base (frozen when trained) and the initialised draft
module (EAGLE3: fc, draft layers, norm, lm_head over the draft vocabulary, d2t/t2d from the
calibration data's token frequencies; Medusa: identity residual blocks, lm_heads copied from
the base). Inputs are validated before anything is written. Under torchrun (nproc = tp * pp)
it uses that group; otherwise it starts tp * pp local processes itself.
"""

import argparse
import logging
import sys
import time

from megatron_specdec import registry
from megatron_specdec.cli.common import ArgumentParser, run_cli

RENAMED = {"--model_path": "--model", "--specdec_algo": "--algo", "--export_dir": "--out",
           "--draft_vocab_size": "--draft-vocab-size", "--calibration_data": "--calibration-data",
           "--num_layers": "--num-layers", "--aux_layers": "--aux-layers",
           "--ttt_steps": "--ttt-steps", "--medusa_num_heads": "--medusa-num-heads"}


def _layer_ids(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}")


def build_parser():
    p = ArgumentParser(description=__doc__, renamed=RENAMED)
    p.add_argument("--model", required=True, help="base Megatron checkpoint directory")
    p.add_argument("--algo", required=True, help=f"one of: {', '.join(registry.attaching())}")
    p.add_argument("--out", required=True, help="speculative checkpoint directory to write")
    p.add_argument("--draft-vocab-size", type=int,
                   help="EAGLE3 draft vocabulary size (default: the full vocabulary); smaller "
                        "sizes need --calibration-data")
    p.add_argument("--calibration-data", nargs="+",
                   help="conversation jsonl file(s) whose token frequencies choose the draft vocabulary")
    p.add_argument("--num-layers", type=int,
                   help="EAGLE3 draft decoder layers / Medusa residual blocks per head (default 1)")
    p.add_argument("--aux-layers", type=_layer_ids,
                   help="EAGLE3 captured base layers, 0-based output-of-layer ids "
                        "(default 1,N//2-1,N-4)")
    p.add_argument("--ttt-steps", type=int, help="EAGLE3 training-time-test steps (default 7)")
    p.add_argument("--medusa-num-heads", type=int, help="Medusa heads (default 4)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to run at (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to run at (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def draft_config(args) -> dict:
    """The draft config dict (the method's config keys) the flags describe; unset flags keep
    defaults. --num-layers is the method's `*_num_layers` key."""
    try:
        cls = registry.get(registry.canonical(args.algo.lower())).config_class
    except registry.UnknownMethodError:
        cls = None  # refused with the valid names when the config is parsed
    keys = registry.user_keys(cls) if cls is not None else []
    flags = {
        next((k for k in keys if k.endswith("_num_layers")), "num_layers"): args.num_layers,
        "draft_vocab_size": args.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": args.aux_layers,
        "ttt_steps": args.ttt_steps,
        "medusa_num_heads": args.medusa_num_heads,
    }
    return {k: v for k, v in flags.items() if v is not None}


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec.loading.conversion import convert_checkpoint

    start = time.time()
    cfg = convert_checkpoint(args.model, args.out, args.algo,
                             draft_config(args), args.calibration_data, tp=args.tp, pp=args.pp,
                             overwrite=args.overwrite)
    logging.getLogger("convert_speculative").info(
        "wrote %s: %s draft (TP=%d, PP=%d) in %.1f s", args.out, cfg.algo, args.tp,
        args.pp, time.time() - start)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
