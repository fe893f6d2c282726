"""Export the draft module of a speculative checkpoint (any saved TP/PP layout) to the Hugging
Face layout TensorRT-LLM, vLLM and SGLang load.

    # the EAGLE3 draft alone (LlamaForCausalLMEagle3: config.json + model.safetensors)
    python checkpoint_tools/export_draft.py --ckpt runs/ckpt/smollm2_eagle3 --out runs/hf/eagle3
    # base model and draft side by side: OUT/base and OUT/eagle3 (or OUT/medusa)
    python checkpoint_tools/export_draft.py --ckpt runs/ckpt/smollm2_eagle3 \\
        --out runs/hf/full --full

Medusa heads are written in the FasterDecoding layout (config.json +
medusa_lm_head.safetensors). The output is written to a temporary directory beside --out and
renamed into place when complete. See docs/export.md for what each engine reads.
"""

import argparse
import logging
import sys
import time

from megatron_specdec.cli import run_cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="speculative checkpoint directory")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--full", action="store_true",
                   help="also export the base model: OUT/base and OUT/<algo>")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the draft's weights (default: as trained; not with --full)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from megatron_specdec import checkpoint
    from megatron_specdec.export import eagle3_hf, full_export, medusa_hf

    start = time.time()
    if args.full:
        if args.dtype:
            raise ValueError("--dtype applies to a draft-only export; "
                             "--full keeps the checkpoint's dtype")
        full_export.export_full(args.ckpt, args.out, overwrite=args.overwrite)
    else:
        algo = checkpoint.read_meta(args.ckpt).get("draft", {}).get("algo", "eagle3")
        export = medusa_hf.export_medusa if algo == "medusa" else eagle3_hf.export_eagle3
        export(args.ckpt, args.out, dtype=args.dtype, overwrite=args.overwrite)
    logging.getLogger("export_draft").info("wrote %s in %.1f s", args.out, time.time() - start)


if __name__ == "__main__":
    sys.exit(run_cli(main))
