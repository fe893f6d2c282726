"""Import a Hugging Face Llama-family model (or the embedded default) into a Megatron
distributed checkpoint (torch_dist) at a chosen tensor/pipeline parallel layout.

    python checkpoint_tools/hf_to_megatron.py --hf_path default --out runs/ckpt/smollm2_tp2 --tp 2

Under torchrun (nproc = tp * pp) it uses that group; otherwise it starts tp * pp local
processes itself (gloo on CPU, NCCL on GPUs).
"""

import argparse
import logging
import sys
import time

from megatron_specdec.cli import run_cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_path", required=True,
                   help="HF model directory (config.json + safetensors), or 'default' for the "
                        "embedded SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--transformer_impl", default="auto",
                   choices=["auto", "local", "transformer_engine"],
                   help="layer implementation: TE when it imports on a GPU, else local")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from megatron_specdec.hf_conversion import hf_to_megatron

    start = time.time()
    out = hf_to_megatron(args.hf_path, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                         overwrite=args.overwrite, transformer_impl=args.transformer_impl)
    logging.getLogger("hf_to_megatron").info(
        "wrote %s (TP=%d, PP=%d) in %.1f s", out, args.tp, args.pp, time.time() - start)


if __name__ == "__main__":
    sys.exit(run_cli(main))
