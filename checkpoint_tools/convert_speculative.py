"""Add an EAGLE3 or Medusa draft module to a Megatron base checkpoint.

    python checkpoint_tools/convert_speculative.py --model_path runs/ckpt/smollm2 \\
        --specdec_algo eagle3 --export_dir runs/ckpt/smollm2_eagle3 \\
        --draft_vocab_size 8192 --calibration_data data/regenerated.jsonl --tp 2

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

from megatron_specdec.cli import run_cli
from megatron_specdec.spec_config import ALGOS


def _layer_ids(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", required=True, help="base Megatron checkpoint directory")
    p.add_argument("--specdec_algo", required=True, help=f"one of: {', '.join(ALGOS)}")
    p.add_argument("--export_dir", required=True, help="speculative checkpoint directory to write")
    p.add_argument("--draft_vocab_size", type=int,
                   help="EAGLE3 draft vocabulary size (default: the full vocabulary); smaller "
                        "sizes need --calibration_data")
    p.add_argument("--calibration_data", nargs="+",
                   help="conversation jsonl file(s) whose token frequencies choose the draft vocabulary")
    p.add_argument("--num_layers", type=int,
                   help="EAGLE3 draft decoder layers / Medusa residual blocks per head (default 1)")
    p.add_argument("--aux_layers", type=_layer_ids,
                   help="EAGLE3 captured base layers, 0-based output-of-layer ids "
                        "(default 1,N//2-1,N-4)")
    p.add_argument("--ttt_steps", type=int, help="EAGLE3 training-time-test steps (default 7)")
    p.add_argument("--medusa_num_heads", type=int, help="Medusa heads (default 4)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to run at (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to run at (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --export_dir")
    return p.parse_args(argv)


def draft_config(args) -> dict:
    """The draft config dict (spec_config keys) the flags describe; unset flags keep defaults."""
    eagle = args.specdec_algo.lower() in ("eagle3", "eagle")
    flags = {
        ("eagle_num_layers" if eagle else "medusa_num_layers"): args.num_layers,
        "draft_vocab_size": args.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": args.aux_layers,
        "ttt_steps": args.ttt_steps,
        "medusa_num_heads": args.medusa_num_heads,
    }
    return {k: v for k, v in flags.items() if v is not None}


def main(argv=None):
    args = parse_args(argv)
    from megatron_specdec.spec_conversion import convert_checkpoint

    start = time.time()
    cfg = convert_checkpoint(args.model_path, args.export_dir, args.specdec_algo,
                             draft_config(args), args.calibration_data, tp=args.tp, pp=args.pp,
                             overwrite=args.overwrite)
    logging.getLogger("convert_speculative").info(
        "wrote %s: %s draft (TP=%d, PP=%d) in %.1f s", args.export_dir, cfg.algo, args.tp,
        args.pp, time.time() - start)


if __name__ == "__main__":
    sys.exit(run_cli(main))
