"""Export the base model of a megatron_specdec checkpoint (any saved TP/PP layout) to a
Hugging Face directory (config.json, model.safetensors, tokenizer) that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

    python checkpoint_tools/megatron_to_hf.py --ckpt runs/ckpt/smollm2_tp2 --out runs/hf/smollm2
"""

import argparse
import logging
import sys
import time

from megatron_specdec.cli import run_cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="megatron_specdec checkpoint directory")
    p.add_argument("--out", required=True, help="HF directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="split the weights into files of at most this many MiB, with an index "
                        "(default 5120, as transformers does)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from megatron_specdec.hf_conversion import DEFAULT_MAX_SHARD_MB, megatron_to_hf

    if args.max_shard_mb is not None and args.max_shard_mb <= 0:
        raise ValueError(f"--max-shard-mb {args.max_shard_mb}: expected a positive size in MiB")
    start = time.time()
    out = megatron_to_hf(args.ckpt, args.out, overwrite=args.overwrite,
                         max_shard_mb=args.max_shard_mb or DEFAULT_MAX_SHARD_MB)
    logging.getLogger("megatron_to_hf").info("wrote %s in %.1f s", out, time.time() - start)


if __name__ == "__main__":
    sys.exit(run_cli(main))
