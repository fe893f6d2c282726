"""Export the base model of a megatron_specdec checkpoint (any saved TP/PP layout) to a
Hugging Face directory (config.json, model.safetensors, tokenizer) that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

    python checkpoint_tools/megatron_to_hf.py --model runs/ckpt/smollm2_tp2 --out runs/hf/smollm2
"""

import logging
import sys
import time

from megatron_specdec.cli.common import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__, renamed={"--ckpt": "--model"})
    p.add_argument("--model", required=True,
                   help="megatron_specdec checkpoint directory (base or speculative)")
    p.add_argument("--out", required=True, help="HF directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="split the weights into files of at most this many MiB, with an index "
                        "(default 5120, as transformers does)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec.loading.hf_conversion import DEFAULT_MAX_SHARD_MB, megatron_to_hf

    if args.max_shard_mb is not None and args.max_shard_mb <= 0:
        raise ValueError(f"--max-shard-mb {args.max_shard_mb}: expected a positive size in MiB")
    start = time.time()
    out = megatron_to_hf(args.model, args.out, overwrite=args.overwrite,
                         max_shard_mb=args.max_shard_mb or DEFAULT_MAX_SHARD_MB)
    logging.getLogger("megatron_to_hf").info("wrote %s in %.1f s", out, time.time() - start)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
