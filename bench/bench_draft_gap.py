"""Where a draft's training agreement and its acceptance in the loop part ways.

For each prompt, greedy speculative generation (chain of k, fixed length) runs first; then
the same draft is run teacher-forced over prompt + continuation as in training (training-time
test, every position at once). Three figures per TTT step k:

- `teacher_forced`: top-1 agreement with the base's next token over every continuation
  position (what the trainer's accuracy measures, here on these prompts);
- `at_round_starts`: the same, restricted to the positions where the loop drafted (round
  start + k, the round having accepted k tokens): the loop's sample of positions;
- `in_loop`: the loop's acceptance at draft position k+1 given k accepted.

A draft whose inference matches its training gives `at_round_starts == in_loop` up to
near-ties (`mismatches` counts the positions where they disagree); a gap between
`teacher_forced` on the training data and on these prompts is distribution shift.

`by_base_confidence` splits step 0's teacher-forced agreement on the prompts by the base's
own top-1 probability for the token drafted (with the share of those tokens the draft
vocabulary holds: the others it cannot draft), and `oracle_al` gives the chain AL of a draft
that is right exactly where the base's top-1 probability is at least c, or wherever the
draft vocabulary holds the token (the loop replayed on the same continuations): where the
remaining acceptance has to come from.

`by_answer_offset` splits step 0's teacher-forced agreement by the drafted token's place in its
answer (bands of 32 tokens), on the prompts and on the training rows: MT-bench reads only an
answer's first 128 tokens. On the training rows step 0 is also split by the base's confidence,
so the prompts and the training data compare at equal difficulty.

    python bench/bench_draft_gap.py --model SPEC_CKPT [--num-prompts 16] [--train-rows 16]
"""

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "draft_gap.json"


CONFIDENCE_EDGES = (0.5, 0.8, 0.95)  # the bands of by_base_confidence and oracle_al's c
OFFSET_BAND, OFFSET_BANDS = 32, 8  # by_answer_offset: [0, 32), ..., [224, 256), >= 256


class Bands:
    """Step-0 hits counted by band: agreement and share of each band."""

    def __init__(self, n):
        self.hit, self.count = torch.zeros(n), torch.zeros(n)

    def add(self, band, hits):
        self.hit.index_add_(0, band, hits.float())
        self.count.index_add_(0, band, torch.ones_like(hits, dtype=torch.float))

    def rows(self, labels, **extra):
        total = float(self.count.sum())
        return [{"band": label, "share": round(float(n) / total, 4) if total else None,
                 "step0_agreement": round(float(h / n), 4) if n else None,
                 **{k: (round(float(v[i] / n), 4) if n else None) for k, v in extra.items()}}
                for i, (label, h, n) in enumerate(zip(labels, self.hit, self.count))]


def confidence_labels():
    edges = (0.0,) + CONFIDENCE_EDGES + (1.0,)
    return [f"[{lo}, {hi}{']' if hi == 1.0 else ')'}" for lo, hi in zip(edges, edges[1:])]


def offset_labels():
    return [f"[{i * OFFSET_BAND}, {(i + 1) * OFFSET_BAND})" for i in range(OFFSET_BANDS)] \
        + [f">= {OFFSET_BANDS * OFFSET_BAND}"]


def confidence_band(conf):
    return torch.bucketize(conf, torch.tensor(CONFIDENCE_EDGES), right=True)


def offset_band(offsets):
    return (offsets // OFFSET_BAND).clamp(max=OFFSET_BANDS)


def answer_offsets(mask):
    """[n] long: each position's place in its run of True (assistant tokens): 0 at a run's
    first token; positions outside a run read 0 and are not scored."""
    out = torch.zeros(mask.numel(), dtype=torch.long)
    for i in range(1, mask.numel()):
        if mask[i] and mask[i - 1]:
            out[i] = out[i - 1] + 1
    return out


@torch.no_grad()
def draft_hits(model, tokens, k):
    """[k, s] bool: TTT step j's draft top-1 at position u equals the base's top-1 at u+1
    (the token u+2 of a greedy continuation); positions without a target are False. Also
    [s] float: the base's top-1 probability for that token (position u+1's softmax max)."""
    draft = model.draft
    ids = torch.tensor([tokens])
    s = ids.shape[1]
    state = model.run_base(ids)
    _, base_logits = model.base_head(state.residual)
    base_probs = base_logits[:, 0, : model.vocab_size].float().softmax(-1)
    base_conf, base_top = base_probs.max(-1)  # [s]
    aux = torch.cat(state.aux, -1)
    embeds = torch.cat([state.embeds[1:], state.embeds[-1:]])
    steps = draft.training_time_test(aux, embeds, model.rotary_pos_emb(s), None, k)
    target_ids = draft.target_ids()
    hits = torch.zeros(k, s, dtype=torch.bool)
    for j, logits in enumerate(steps):
        pred = target_ids[logits[:, 0, : draft.draft_vocab_size].argmax(-1)]
        hits[j, : s - 2] = pred[: s - 2] == base_top[1: s - 1]
    conf = torch.zeros(s)
    conf[: s - 2] = base_conf[1: s - 1]
    return hits, conf


def replay_chain(accept, start, end, k):
    """Accepted drafts of every round of a fixed chain of k over positions start..end-1 when
    the draft of TTT step j at position u is accepted iff accept(j, u): a round at pending
    position r drafts positions r-1+j and emits its accepted prefix plus one base token."""
    accepted, r = [], start
    while r < end:
        a = 0
        while a < k and r + 1 + a < end and accept(a, r - 1 + a):
            a += 1
        accepted.append(a)
        r += a + 1
    return accepted


def chain_al(accepted):
    """Tokens emitted per round (verify forward) of rounds that accepted these counts."""
    return round(sum(a + 1 for a in accepted) / len(accepted), 4) if accepted else None


def loop_positions(prompt_len, accepted, length, k):
    """[(TTT step j, position u, accepted?)] of every draft the loop verified: round i's
    pending token sits at r_i, its draft j scores token r_i+1+j, i.e. TTT step j at
    u = r_i-1+j; drafts past the first rejection were not verified given their prefix."""
    out, r = [], prompt_len
    for a in accepted:
        for j in range(min(a + 1, k)):
            if r + 1 + j < length:
                out.append((j, r - 1 + j, j < a))
        r += a + 1
    return out


def measure(model, tokenizer, prompts, k, max_new_tokens):
    from megatron_specdec.data import end_of_turn_ids
    from megatron_specdec.inference.generator import SpeculativeGenerator

    gen = SpeculativeGenerator(model, k, policy="fixed")
    eos = end_of_turn_ids(tokenizer)
    tf, starts, loop, mismatches = [[0, 0] for _ in range(k)], \
        [[0, 0] for _ in range(k)], [[0, 0] for _ in range(k)], 0
    by_conf, in_vocab_count = Bands(len(CONFIDENCE_EDGES) + 1), torch.zeros(len(CONFIDENCE_EDGES) + 1)
    by_offset = Bands(OFFSET_BANDS + 1)
    replays = {}  # rule -> accepted counts of every replayed round
    loop_accepted = []
    t2d = model.draft.t2d.cpu()
    for ids in prompts:
        result = gen.generate(ids, max_new_tokens, eos)
        full = list(ids) + result.tokens
        hits, conf = draft_hits(model, full, k)
        first = len(ids) - 1  # position P-1 scores token P+1, the first the loop drafts
        row, row_conf = hits[0, first: len(full) - 2], conf[first: len(full) - 2]
        in_vocab = t2d[torch.tensor(full)]  # token u+2 is the one step 0 at u drafts
        row_vocab = in_vocab[first + 2: len(full)]
        which = confidence_band(row_conf)
        by_conf.add(which, row)
        in_vocab_count.index_add_(0, which, row_vocab.float())
        by_offset.add(offset_band(torch.arange(row.numel()) + 1), row)  # row i drafts token P+1+i
        rules = {f">= {c}": lambda j, u, c=c: bool(conf[u] >= c) for c in CONFIDENCE_EDGES}
        rules["in draft vocabulary"] = lambda j, u: bool(in_vocab[u + 2])
        # the draft's own teacher-forced hits: checks the replay against the loop
        rules["own hits"] = lambda j, u: bool(hits[j, u])
        for name, rule in rules.items():
            replays.setdefault(name, []).extend(replay_chain(rule, len(ids), len(full), k))
        loop_accepted += result.accepted
        for j in range(k):
            row = hits[j, first + j: len(full) - 2]
            tf[j][0] += int(row.sum())
            tf[j][1] += row.numel()
        for j, u, ok in loop_positions(len(ids), result.accepted, len(full), k):
            starts[j][0] += int(hits[j, u])
            starts[j][1] += 1
            loop[j][0] += int(ok)
            loop[j][1] += 1
            mismatches += int(hits[j, u]) != int(ok)
    rate = lambda c: [round(a / n, 4) if n else None for a, n in c]  # noqa: E731
    return {"teacher_forced": rate(tf), "at_round_starts": rate(starts), "in_loop": rate(loop),
            "verified_drafts": sum(n for _, n in loop), "mismatches": mismatches,
            "rounds": len(loop_accepted), "al": chain_al(loop_accepted),
            "replayed_al": chain_al(replays.pop("own hits")),
            "by_base_confidence": by_conf.rows(confidence_labels(), in_draft_vocab=in_vocab_count),
            "by_answer_offset": by_offset.rows(offset_labels()),
            "oracle_al": {name: chain_al(counts) for name, counts in replays.items()}}


@torch.no_grad()
def train_agreement(model, tokenizer, files, rows, k, seq_length=512):
    """Teacher-forced step-j agreement on the first `rows` conversations of the training data
    (assistant tokens only, as the trainer scores them)."""
    from megatron_specdec.data import ConversationDataset

    dataset = ConversationDataset.from_files(files, tokenizer, seq_length, False, 0, "skip")
    hit, count = torch.zeros(k), torch.zeros(k)
    by_conf, by_offset = Bands(len(CONFIDENCE_EDGES) + 1), Bands(OFFSET_BANDS + 1)
    for i in range(min(rows, len(dataset))):
        row = dataset[i]
        n = int((row["segment_ids"] > 0).sum())
        tokens = row["input_ids"][:n].tolist()
        hits, conf = draft_hits(model, tokens, k)
        target = row["loss_mask"][:n].bool()
        for j in range(k):
            scored = torch.zeros(n, dtype=torch.bool)
            scored[j: n - 2] = target[j + 2:]  # position u scores token u+2
            hit[j] += hits[j][scored].sum()
            count[j] += scored.sum()
        step0 = torch.zeros(n, dtype=torch.bool)
        step0[: n - 2] = target[2:]
        by_conf.add(confidence_band(conf[step0]), hits[0][step0])
        offsets = answer_offsets(target)[2:]  # the place of token u+2, the one u drafts
        by_offset.add(offset_band(offsets[step0[: n - 2]]), hits[0][step0])
    return {"by_step": [round(float(h / c), 4) if c else None for h, c in zip(hit, count)],
            "by_base_confidence": by_conf.rows(confidence_labels()),
            "by_answer_offset": by_offset.rows(offset_labels())}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="speculative checkpoint with an EAGLE3 draft")
    p.add_argument("--prompts", default=str(REPO / "data" / "sources" / "mt_bench.jsonl"))
    p.add_argument("--num-prompts", type=int, default=16, help="spread over the file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--train-data", nargs="*", default=[str(REPO / "data" / "smollm2_regen.jsonl.gz"),
                                                       str(REPO / "data" / "smollm2_regen_general.jsonl.gz")])
    p.add_argument("--train-rows", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()

    from megatron_specdec.cli.common import setup_logging

    setup_logging()  # before megatron-core is imported: its benign warnings stay out
    from megatron_specdec.evaluation.acceptance import read_prompts
    from megatron_specdec.distributed import initialize
    from megatron_specdec.loading.speculative import load_speculative
    from megatron_specdec.data import load_tokenizer

    initialize(1, 1)
    model, _, _ = load_speculative(args.model)
    model.eval()
    tokenizer = load_tokenizer(str(Path(args.model) / "tokenizer"))
    every = read_prompts(args.prompts, tokenizer)
    stride = max(1, len(every) // args.num_prompts)
    prompts = [ids for _, ids in every[::stride][: args.num_prompts]]
    start = time.time()
    report = {"model": args.model, "prompts": f"{args.prompts}, every {stride}th, "
                                              f"{len(prompts)} prompts",
              "max_new_tokens": args.max_new_tokens, "k": args.k,
              **measure(model, tokenizer, prompts, args.k, args.max_new_tokens)}
    files = [f for f in args.train_data if Path(f).is_file()]
    train = train_agreement(model, tokenizer, files, args.train_rows, args.k)
    report["train_teacher_forced"] = train.pop("by_step")
    report["train_step0"] = train
    report["train_data"] = f"{files}, first {args.train_rows} conversations"
    report["seconds"] = round(time.time() - start, 1)
    print(f"{'TTT step':>8} {'train TF':>9} {'prompts TF':>10} {'round starts':>12} {'in loop':>8}")
    for j in range(args.k):
        cells = [report["train_teacher_forced"][j], report["teacher_forced"][j],
                 report["at_round_starts"][j], report["in_loop"][j]]
        print(f"{j:>8} " + " ".join(f"{'-' if c is None else c:>{w}}"
                                    for c, w in zip(cells, (9, 10, 12, 8))))
    print(f"loop drafts verified: {report['verified_drafts']}, disagreeing with teacher forcing:"
          f" {report['mismatches']}; rounds {report['rounds']}")
    for split, title in (("by_base_confidence", "the base's top-1 probability"),
                         ("by_answer_offset", "the drafted token's place in its answer")):
        print(f"step-0 agreement by {title} (prompts | training rows):")
        for b, t in zip(report[split], report["train_step0"][split]):
            vocab = f", in the draft vocabulary {b['in_draft_vocab']}" if "in_draft_vocab" in b else ""
            print(f"  {b['band']:>12}: {b['share'] or 0:.1%} of positions, agreement "
                  f"{b['step0_agreement']}{vocab} | {t['share'] or 0:.1%}, {t['step0_agreement']}")
    print(f"AL in the loop {report['al']}, replayed from teacher forcing {report['replayed_al']}")
    print("chain AL of a draft right exactly where: "
          + ", ".join(f"top-1 probability {c}: {al}" if c.startswith(">=") else f"{c}: {al}"
                      for c, al in report["oracle_al"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
