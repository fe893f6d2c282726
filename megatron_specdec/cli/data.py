"""Training data for a draft: the target model's own answers to prompts (regenerate), prompts
it writes itself (synthesize), about given passages (ground) or of the task kinds users ask
(tasks), the draft vocabulary (calibrate), and the prompt sources (sources).

    python -m megatron_specdec.cli.data {regenerate,synthesize,ground,tasks,calibrate,sources} --help
"""

import logging
import sys

from megatron_specdec.cli.common import USER_ERRORS, ArgumentParser, setup_logging
from megatron_specdec.data.jsonl import ON_ERROR_CHOICES, DataError, read_list_file
from megatron_specdec.data.openai_backend import BackendError
from megatron_specdec.data.sources import PRESETS, TRAIN_PRESETS

log = logging.getLogger("megatron_specdec.data")


def _source_args(p, default_sources):
    p.add_argument(
        "--sources",
        default=",".join(default_sources),
        help=f"comma-separated preset names (default: %(default)s; presets: {', '.join(PRESETS)})",
    )
    p.add_argument(
        "--source-spec",
        action="append",
        default=[],
        metavar="JSON",
        help='extra jsonl source, e.g. \'{"name": "mine", "file": "/x.jsonl", "prompt": "question"}\' '
        "(fields of SourceSpec; repeatable)",
    )
    p.add_argument(
        "--data-dir", help="directory that preset (and relative) source files are read from"
    )
    p.add_argument(
        "--on-error",
        choices=ON_ERROR_CHOICES,
        default="skip",
        help="bad input rows (default: skip)",
    )


def _backend_args(p):
    p.add_argument(
        "--backend",
        choices=("megatron", "openai"),
        required=True,
        help="megatron: generate in this process from --model; openai: ask a served model "
        "(vLLM, SGLang, ...) at --url",
    )
    p.add_argument(
        "--tokenizer",
        help="HF tokenizer dir of the target, or 'default' "
        "(default: the checkpoint's for megatron, 'default' for openai)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="megatron backend: the parameters' dtype (default: the checkpoint's; float32 for "
        "'default'). bfloat16 is for GPUs: on the 2-core AVX512-BF16 CPU it generated at 0.65x "
        "float32's tokens/s (batch 64, bench/bench_regenerate.py)",
    )
    p.add_argument(
        "--prompt-bucket",
        type=int,
        default=None,
        help="megatron backend: prompt batches are left-padded to a multiple of this many "
        "tokens, so a long run meets few prefill shapes (bf16 keeps a kernel per shape; "
        "default: generation.PROMPT_BUCKET)",
    )
    p.add_argument("--url", help="openai backend: server root, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--model",
        help="megatron backend: checkpoint, HF directory or 'default' (the default); "
        "openai backend: the name the server serves the model under",
    )
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="openai backend: token-id prompts (exact template) or chat messages",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="openai backend: seconds per request"
    )
    p.add_argument("--max-retries", type=int, default=5, help="openai backend: retries per request")


def _specs(args) -> list:
    names = [s for s in args.sources.split(",") if s]
    return names + args.source_spec


def _backend(args):
    """(backend, tokenizer) named by the shared --backend flags."""
    from megatron_specdec.data.conversations import load_tokenizer

    if args.backend == "openai":
        from megatron_specdec.data.openai_backend import OpenAIBackend

        if not args.url or not args.model:
            raise DataError("--backend openai needs --url and --model")
        tokenizer = load_tokenizer(args.tokenizer or "default")
        backend = OpenAIBackend(
            args.url, args.model, tokenizer, args.endpoint, args.timeout, args.max_retries
        )
        return backend, tokenizer
    from megatron_specdec.inference.data_backend import MegatronBackend

    backend = MegatronBackend(
        args.model or "default", load_tokenizer(args.tokenizer) if args.tokenizer else None,
        args.dtype,
        args.prompt_bucket,
    )
    return backend, backend.tokenizer


def _regenerate(args):
    from megatron_specdec.data.conversations import read_conversations
    from megatron_specdec.data.regenerate import regenerate, select_shard, shard_output_path
    from megatron_specdec.data.sources import read_sources

    rows = read_sources(_specs(args), args.data_dir, args.on_error)
    if args.exclude:
        answered = {row["id"] for row in read_conversations(args.exclude, args.on_error)}
        rows = [r for r in rows if r.id not in answered]
    rows = select_shard(rows, args.shard_index, args.num_shards, args.limit)
    out = shard_output_path(args.out, args.shard_index, args.num_shards)
    backend, tokenizer = _backend(args)
    log.info("shard %d/%d: %d prompts -> %s", args.shard_index, args.num_shards, len(rows), out)
    regenerate(
        rows,
        backend,
        tokenizer,
        out,
        args.batch_size,
        args.max_new_tokens,
        args.system_prompt,
        progress=not args.no_progress,
    )


def _synthesize(args):
    from megatron_specdec.data.synthesize import synthesize_prompts

    backend, tokenizer = _backend(args)
    synthesize_prompts(
        backend,
        tokenizer,
        args.out,
        args.num_prompts,
        args.batch_size,
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        system_prompt=args.system_prompt,
        user_prefixes=_read_prefixes(args.user_prefixes) if args.user_prefixes else (),
        progress=not args.no_progress,
    )


def _ground(args):
    from megatron_specdec.data import grounded

    requests = grounded.read_instructions(args.instructions)
    passages = grounded.read_passages(args.conversations, args.min_chars, args.max_chars,
                                      args.on_error)
    rows = grounded.grounded_prompts(passages, requests, args.num_prompts, args.seed)
    grounded.write_prompts(rows, args.out)


def _tasks(args):
    from megatron_specdec.data import tasks
    from megatron_specdec.data.conversations import load_tokenizer

    kinds = tasks.check_kinds(args.kinds.split(","))
    root = tasks.stdlib_dir(args.stdlib)
    tokenizer = load_tokenizer(args.tokenizer)
    train, heldout = tasks.build_tasks(
        root, lambda text: len(tokenizer.encode(text)), kinds, args.train_per_kind,
        args.heldout_per_kind, args.seed)
    if args.long_out:
        tasks.write_rows([r for r in train if r.kind == "summarize_long"], args.long_out)
        train = [r for r in train if r.kind != "summarize_long"]
    tasks.write_rows(train, args.out)
    tasks.write_rows(heldout, args.heldout_out)


def _read_prefixes(path) -> list:
    """One prefix a line; blank lines and lines starting with '#' are skipped."""
    return [text for _, text in read_list_file(path, "--user-prefixes", "prefixes")]


def _calibrate(args):
    from megatron_specdec.data.conversations import end_of_turn_ids, load_tokenizer
    from megatron_specdec.data.draft_vocab import calibrate

    tokenizer = load_tokenizer(args.tokenizer)
    vocab = calibrate(
        args.data,
        tokenizer,
        args.draft_vocab_size,
        not args.all_tokens,
        args.max_length,
        args.vocab_size,
        args.on_error,
    )
    covered = vocab.counts[vocab.t2d].sum() / vocab.counts.sum()
    vocab.save(
        args.out,
        {
            "draft_vocab_size": vocab.draft_vocab_size,
            "vocab_size": vocab.vocab_size,
            "data": [str(p) for p in args.data],
            "tokenizer": str(args.tokenizer),
            "assistant_only": not args.all_tokens,
            "max_length": args.max_length,
            "always_included": sorted(end_of_turn_ids(tokenizer)),
        },
    )
    log.info(
        "draft vocab %d/%d covers %.2f%% of counted tokens -> %s",
        vocab.draft_vocab_size,
        vocab.vocab_size,
        100 * float(covered),
        args.out,
    )


def _sources(args):
    from megatron_specdec.data.sources import parse_source, read_source

    for spec in _specs(args):
        spec = parse_source(spec)
        rows = read_source(spec, args.data_dir, args.on_error)
        print(f"{spec.name}\t{spec.split}\t{len(rows)} rows\t{spec.file}")


def build_parser():
    parser = ArgumentParser(prog="python -m megatron_specdec.cli.data", description=__doc__,
                            renamed={"--checkpoint": "--model"})
    parser.add_argument("--log-level", help="DEBUG, INFO (default), WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "regenerate", help="answer training prompts with the target model (self-distillation)"
    )
    _source_args(p, TRAIN_PRESETS)
    p.add_argument(
        "--out", required=True, help="conversations jsonl (appended; a rerun resumes it)"
    )
    _backend_args(p)
    p.add_argument("--batch-size", type=int, default=32, help="prompts generated together")
    p.add_argument("--max-new-tokens", type=int, default=512, help="answer tokens at most")
    p.add_argument(
        "--system-prompt", help="system message for every conversation (default: the template's)"
    )
    p.add_argument("--shard-index", type=int, default=0, help="this process's shard, 0-based")
    p.add_argument(
        "--num-shards", type=int, default=1, help="shard i writes OUT with a .shardI-of-N suffix"
    )
    p.add_argument(
        "--limit", type=int, help="only the first N prompts of this shard (a mix of all sources)"
    )
    p.add_argument(
        "--exclude",
        nargs="+",
        metavar="FILE",
        help="skip the prompts these conversation files already answer (e.g. "
        "data/smollm2_regen.jsonl.gz), so --limit takes the next ones: a dataset grown, not redone",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_regenerate)

    p = sub.add_parser(
        "synthesize",
        help="sample user prompts from the target itself (Magpie-style), for `regenerate`",
    )
    _backend_args(p)
    p.add_argument("--out", required=True, help="prompts jsonl ({id, prompt}; a rerun resumes it)")
    p.add_argument("--num-prompts", type=int, required=True, help="candidates to sample")
    p.add_argument("--batch-size", type=int, default=256, help="candidates sampled together")
    p.add_argument("--max-new-tokens", type=int, default=96, help="longer candidates are dropped")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="sampling nucleus mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (a rerun samples the same)")
    p.add_argument("--system-prompt", help="system message before the user turn (default: none)")
    p.add_argument(
        "--user-prefixes",
        help="text file, one prefix a line: row i's user text starts with prefix i mod N "
        "(e.g. data/synth_user_prefixes.txt, steered to MT-bench-like categories)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_synthesize)

    p = sub.add_parser(
        "ground",
        help="requests about a given text (extract, summarise, rewrite), passages from earlier "
        "answers, for `regenerate`",
    )
    p.add_argument("--conversations", nargs="+", required=True,
                   help="conversations jsonl(.gz) whose assistant turns are the passages")
    p.add_argument("--instructions", required=True,
                   help="requests with {text}, one a line (e.g. data/grounded_instructions.txt)")
    p.add_argument("--num-prompts", type=int, required=True, help="prompts to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the passage/request pairing")
    p.add_argument("--min-chars", type=int, default=300, help="shorter passages are skipped")
    p.add_argument("--max-chars", type=int, default=1000,
                   help="passages are cut at a paragraph or sentence end within this")
    p.add_argument("--on-error", choices=ON_ERROR_CHOICES, default="skip",
                   help="bad input rows (default: skip)")
    p.add_argument("--out", required=True, help="prompts jsonl ({id, prompt})")
    p.set_defaults(func=_ground)

    p = sub.add_parser(
        "tasks",
        help="prompts of task kinds (long summaries, passage QA, extraction, translation, code) "
        "from CPython's own docs and sources, with a held-out split on other documents",
    )
    p.add_argument("--out", required=True, help="training prompts jsonl(.gz)")
    p.add_argument("--heldout-out", required=True, help="held-out prompts jsonl(.gz)")
    p.add_argument("--long-out", help="training summarize_long prompts go here instead of --out, "
                   "to be answered at a smaller batch (a batch pads to its longest prompt)")
    p.add_argument("--kinds", default="summarize_long,passage_qa,extraction,translation,code",
                   help="comma-separated task kinds (default: %(default)s)")
    p.add_argument("--train-per-kind", type=int, default=100, help="training prompts per kind")
    p.add_argument("--heldout-per-kind", type=int, default=16, help="held-out prompts per kind")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling and the split")
    p.add_argument("--stdlib", help="CPython stdlib directory (default: this interpreter's)")
    p.add_argument("--tokenizer", default="default",
                   help="HF tokenizer dir that measures long documents (default: SmolLM2's)")
    p.set_defaults(func=_tasks)

    p = sub.add_parser("calibrate", help="build the draft vocabulary (d2t, t2d) from conversations")
    p.add_argument("--data", nargs="+", required=True, help="conversations jsonl file(s)")
    p.add_argument(
        "--tokenizer", default="default", help="HF tokenizer dir of the target, or 'default'"
    )
    p.add_argument("--draft-vocab-size", type=int, required=True,
                   help="tokens in the draft vocabulary (the most frequent)")
    p.add_argument("--out", required=True, help="output .safetensors (d2t, t2d, counts)")
    p.add_argument(
        "--all-tokens", action="store_true", help="count every token, not only assistant tokens"
    )
    p.add_argument("--max-length", type=int, help="truncate conversations as training does")
    p.add_argument(
        "--vocab-size", type=int, help="t2d length (default: the model's, from config.json)"
    )
    p.add_argument(
        "--on-error",
        choices=ON_ERROR_CHOICES,
        default="skip",
        help="bad input rows (default: skip)",
    )
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("sources", help="list prompt sources and check their rows")
    _source_args(p, PRESETS)
    p.set_defaults(func=_sources)
    return parser


def main(argv=None) -> int:
    """Runs a subcommand; bad input is logged as one line and returns 1."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level.upper() if args.log_level else None)
    try:
        args.func(args)
    except (DataError, BackendError, ImportError, *USER_ERRORS) as e:
        log.error("%s", e)
        return 1
    return 0


def cli() -> int:
    """Console entry point (setup.py)."""
    return main()


if __name__ == "__main__":
    sys.exit(cli())
