"""Export the draft module of a speculative checkpoint (any saved TP/PP layout) to the Hugging
Face layout TensorRT-LLM, vLLM and SGLang load.

    # the EAGLE3 draft alone (LlamaForCausalLMEagle3: config.json + model.safetensors)
    python checkpoint_tools/export_draft.py --model runs/ckpt/smollm2_eagle3 --out runs/hf/eagle3
    # base model and draft side by side: OUT/base and OUT/eagle3 (or OUT/medusa)
    python checkpoint_tools/export_draft.py --model runs/ckpt/smollm2_eagle3 \\
        --out runs/hf/full --full
    # then serve it in vLLM (the env `make vllm-env` creates): greedy-identical, draft alive
    python checkpoint_tools/export_draft.py --model runs/ckpt/smollm2_eagle3 --out runs/hf/eagle3 \\
        --verify-with vllm

Medusa heads are written in the FasterDecoding layout (config.json +
medusa_lm_head.safetensors). The output is written to a temporary directory beside --out and
renamed into place when complete. See docs/export.md for what each engine reads.
"""

import logging
import sys
import time

from megatron_specdec.cli.common import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__, renamed={"--ckpt": "--model"})
    p.add_argument("--model", required=True,
                   help="speculative checkpoint directory, or a trainer's checkpoint")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--full", action="store_true",
                   help="also export the base model: OUT/base and OUT/<algo>")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the draft's weights (default: as trained; not with --full)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--max-shard-mb", type=float,
                   help="EAGLE3: split the weights into safetensors files of at most this many "
                        "MB with an index (e.g. 15 to commit under a 16 MB file limit)")
    p.add_argument("--verify-with", choices=("vllm",),
                   help="serve the EAGLE3 export in vLLM on a few prompts: its speculative "
                        "output must equal its greedy output and its acceptance length must "
                        "reach --min-acceptance-length (the export stays written if it fails)")
    p.add_argument("--verify-base",
                   help="HF directory of the base for --verify-with (default: OUT/base with "
                        "--full, else the checkpoint's base written to a temporary directory)")
    p.add_argument("--min-acceptance-length", type=float,
                   help="acceptance-length floor of --verify-with (default 1.02; 1.0 = dead)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec import registry
    from megatron_specdec.export import draft_source, full_export

    algo = draft_source.draft_meta(args.model).get("draft", {}).get("algo", "eagle3")
    method = registry.get(algo)
    if args.verify_with and method is not registry.get("eagle3"):
        raise ValueError(f"--verify-with checks EAGLE3 exports; {args.model} holds a {algo} "
                         f"draft (vLLM 0.32's Medusa support is described in the README)")
    if (args.verify_base or args.min_acceptance_length) and not args.verify_with:
        raise ValueError("--verify-base and --min-acceptance-length need --verify-with vllm")
    start = time.time()
    if args.full:
        if args.dtype:
            raise ValueError("--dtype applies to a draft-only export; "
                             "--full keeps the checkpoint's dtype")
        full_export.export_full(args.model, args.out, overwrite=args.overwrite)
    else:
        if method.export_hf is None:
            raise ValueError(f"{args.model} holds a {algo} draft, which has no HF export")
        method.export_hf(args.model, args.out, dtype=args.dtype, overwrite=args.overwrite,
                         max_shard_mb=args.max_shard_mb)
    logging.getLogger("export_draft").info("wrote %s in %.1f s", args.out, time.time() - start)
    if args.verify_with:
        verify(args)


def verify(args):
    """Serve the export in vLLM (engines/verify_export.py); the base comes from --verify-base,
    OUT/base (--full), or the checkpoint's base written to a temporary HF directory."""
    import tempfile
    from pathlib import Path

    from megatron_specdec.engines import verify_export
    from megatron_specdec.loading.hf_conversion import megatron_to_hf

    out = Path(args.out)
    draft = out / "eagle3" if args.full else out
    floor = args.min_acceptance_length or verify_export.MIN_ACCEPTANCE_LENGTH
    with tempfile.TemporaryDirectory(prefix=".verify_base_", dir=out.parent) as tmp:
        base = args.verify_base or (out / "base" if args.full else None)
        if base is None:
            base = Path(tmp) / "base"
            megatron_to_hf(args.model, base)
        verify_export.verify_eagle3(draft, base, min_acceptance_length=floor)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
