"""Answer chat prompts by greedy generation from a Megatron model, at any TP/PP.

    torchrun --nproc-per-node 2 -m megatron_specdec.cli.chat --model runs/demo/smollm2_tp2 --tp 2 \\
        --prompt "What is the capital of France?"

--model takes a megatron_specdec checkpoint, an HF directory, or 'default'.
"""

import sys
import time

from megatron_specdec.cli.common import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__, renamed={"--max_new_tokens": "--max-new-tokens"})
    p.add_argument("--model", default="default", help="checkpoint, HF directory or 'default'")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--prompt", action="append", required=True,
                   help="a user message (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer at most")
    p.add_argument("--prompt-bucket", type=int, default=None,
                   help="prompts are left-padded to a multiple of this many tokens (few "
                        "prefill shapes; default: generation.PROMPT_BUCKET)")
    return p


def chat(model_path, prompts, max_new_tokens=128, tp=1, pp=1, prompt_bucket=None):
    """Greedy answers to `prompts` (user messages); collective over the model-parallel group."""
    from transformers import AutoTokenizer

    from megatron_specdec import distributed
    from megatron_specdec.data import end_of_turn_ids
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.loading.source import load_model

    distributed.initialize(tp, pp)
    loaded = load_model(model_path, with_draft=False)
    model, config, tokenizer_dir = loaded.model, loaded.hf_config, loaded.tokenizer_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                         add_generation_prompt=True, return_dict=False)
           for p in prompts]
    start = time.time()
    out = plain_generate(model, ids, max_new_tokens, config.vocab_size,
                         eos_ids=end_of_turn_ids(tokenizer), prompt_bucket=prompt_bucket)
    seconds = time.time() - start
    return [tokenizer.decode(o) for o in out], sum(map(len, out)) / seconds


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron_specdec.distributed import is_rank0

    answers, speed = chat(args.model, args.prompt, args.max_new_tokens, args.tp, args.pp,
                          args.prompt_bucket)
    if is_rank0():
        for prompt, answer in zip(args.prompt, answers):
            print(f"\n>>> {prompt}\n{answer}")
        print(f"\n[{speed:.1f} tokens/s, TP={args.tp} PP={args.pp}]")


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
