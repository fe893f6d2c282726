"""Import a Hugging Face Llama-family model (or the embedded default) into a Megatron
distributed checkpoint (torch_dist) at a chosen tensor/pipeline parallel layout.

    python checkpoint_tools/hf_to_megatron.py --model default --out runs/ckpt/smollm2_tp2 --tp 2

Mixture-of-experts families (Qwen3-MoE, Mixtral) also take --ep, the expert parallel size:
each rank reads only its experts, and the checkpoint loads at any TP/PP/EP.
Under torchrun (nproc = tp * pp * ep) it uses that group; otherwise it starts tp * pp * ep local
processes itself (gloo on CPU, NCCL on GPUs).
"""

import logging
import sys
import time

from megatron_specdec.cli.common import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__, renamed={"--hf_path": "--model",
                                                     "--transformer_impl": "--transformer-impl"})
    p.add_argument("--model", required=True,
                   help="HF model directory (config.json + safetensors), or 'default' for the "
                        "embedded SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel size of an MoE family (default 1; must divide the experts)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the checkpoint's parameters are stored in")
    p.add_argument("--transformer-impl", default="auto",
                   choices=["auto", "local", "transformer_engine"],
                   help="layer implementation: TE when it imports on a GPU, else local")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec.loading.hf_conversion import hf_to_megatron

    start = time.time()
    out = hf_to_megatron(args.model, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                         overwrite=args.overwrite, transformer_impl=args.transformer_impl, ep=args.ep)
    logging.getLogger("hf_to_megatron").info(
        "wrote %s (TP=%d, PP=%d, EP=%d) in %.1f s", out, args.tp, args.pp, args.ep, time.time() - start)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
