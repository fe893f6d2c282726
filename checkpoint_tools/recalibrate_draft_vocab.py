"""Give a trained EAGLE3 draft (HF layout) the draft vocabulary of new calibration data: the
N most frequent assistant tokens, trained lm_head rows kept for tokens in both vocabularies,
the base's output rows for the new ones. Train it afterwards (its new rows start untrained).

    python checkpoint_tools/recalibrate_draft_vocab.py --draft models/eagle3_smollm2 \\
        --model default --data data/smollm2_regen_steered9.jsonl.gz \\
        --draft-vocab-size 16384 --out runs/eagle3_v16k --max-shard-mb 15

Written to a temporary directory beside --out and renamed into place when complete.
"""

import sys

from megatron_specdec.cli.common import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__, renamed={"--hf_path": "--model"})
    p.add_argument("--draft", required=True, help="HF EAGLE3 draft directory")
    p.add_argument("--model", default="default",
                   help="the base's HF directory, or 'default' (its tokenizer and output layer)")
    p.add_argument("--data", required=True, nargs="+", help="conversation jsonl(.gz) files")
    p.add_argument("--draft-vocab-size", type=int,
                   help="size of the new draft vocabulary (default: the draft's own)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--max-shard-mb", type=float,
                   help="split the weights into files of at most this many MB, with an index")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec.models.default_model import resolve_model_path
    from megatron_specdec.methods.eagle3.vocab_recalibrate import recalibrate

    result = recalibrate(args.draft, resolve_model_path(args.model), args.data, args.out,
                         args.draft_vocab_size, args.max_shard_mb, args.overwrite)
    print(f"wrote {args.out}: {result.kept} tokens kept, {result.added} new; the calibration "
          f"data's assistant tokens in the draft vocabulary: {result.coverage_before:.2%} before, "
          f"{result.coverage_after:.2%} after")


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
