"""EAGLE3 training cost on SmolLM2-135M-Instruct, and how the loss's memory scales.

1. Training step (base forward, draft training-time test, vocab-parallel loss, backward,
   AdamW step) at TP=1 and TP=2 with ttt_steps 1, 3 and 7: mean step time and each rank's
   peak RSS during the steps (sampled every 2 ms; max over ranks), beside its RSS before.
2. The loss alone (draft-vocabulary target exchange + soft cross-entropy, forward and
   backward) on synthetic logits as the vocabulary grows (draft vocabulary = V/4): each
   rank's peak RSS increase over its baseline, at TP=1 and TP=2. It must scale as V/TP:
   no rank ever holds a [tokens, V] tensor.

    python bench/bench_eagle3_train.py [--quick]   # table + bench/results/eagle3_train.json
"""

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from megatron_specdec import distributed

RESULTS = Path(__file__).resolve().parent / "results" / "eagle3_train.json"


class PeakRSS:
    """Peak resident memory of this process while the block runs."""

    def __enter__(self):
        self.proc, self.peak, self.stop = psutil.Process(), 0, False
        self.before = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def _gather_max(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def train_worker(tp, ttt_list, seq_len, steps, draft_vocab, out_file):
    from megatron_specdec.models.speculative import convert
    from megatron_specdec.loading.hf_conversion import model_from_hf
    from megatron_specdec.training.schedule import forward_backward

    distributed.initialize(tp, 1)
    base, hf = model_from_hf("default")
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, hf.vocab_size, (1, seq_len), generator=g),
             "loss_mask": torch.ones(1, seq_len)}
    rows = []
    for ttt in ttt_list:
        model = convert(base, "eagle3", {"ttt_steps": ttt, "draft_vocab_size": draft_vocab},
                        hf_config=hf)
        optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad()
            forward_backward(model, [batch])
            optimizer.step()

        step()  # warm-up: optimizer state, allocator
        with PeakRSS() as mem:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            seconds = (time.perf_counter() - start) / steps
        rows.append({"tp": tp, "ttt_steps": ttt, "step_seconds": _gather_max(seconds),
                     "rank_rss_before_mib": _gather_max(mem.before / 2**20),
                     "rank_peak_rss_mib": _gather_max(mem.peak / 2**20)})
        del model, optimizer
    if torch.distributed.get_rank() == 0:
        torch.save(rows, out_file)


def loss_worker(tp, vocab, tokens, out_file):
    """Peak RSS increase of the vocab-parallel EAGLE3 loss on this rank's logit shards."""
    from megatron_specdec.models.layers import losses

    distributed.initialize(tp, 1)
    draft = vocab // 4
    g = torch.Generator().manual_seed(tp)
    target_ids = torch.arange(0, vocab, 4)  # every 4th token: spread over all TP ranks
    torch.distributed.barrier()
    with PeakRSS() as mem:
        base = torch.randn(tokens, vocab // tp, generator=g)
        logits = torch.randn(tokens, draft // tp, generator=g, requires_grad=True)
        target = losses.draft_target_logits(base, target_ids, draft)
        losses.soft_cross_entropy(logits, losses.target_probs(target)).sum().backward()
        del base, logits, target
    delta = _gather_max((mem.peak - mem.before) / 2**20)
    if torch.distributed.get_rank() == 0:
        torch.save({"tp": tp, "vocab": vocab, "draft_vocab": draft, "tokens": tokens,
                    "rank_peak_increase_mib": delta,
                    "full_vocab_tensor_mib": tokens * vocab * 4 / 2**20}, out_file)


def _run(fn, world, *args):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.pt"
        distributed.spawn(fn, world, *args, str(out))
        return torch.load(out, weights_only=False)


def main(argv=None):
    from megatron_specdec.cli.common import setup_logging

    setup_logging()  # quiet logs: benign library warnings off
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter sequences, fewer steps and vocabularies")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    seq_len, steps = (64, 1) if args.quick else (args.seq_len, args.steps)
    vocabs = [32768, 65536] if args.quick else [32768, 65536, 131072, 262144]
    tokens = 512 if args.quick else 2048

    load_before = os.getloadavg()
    train = []
    for tp in (1, 2):
        train += _run(train_worker, tp, tp, [1, 3, 7], seq_len, steps, 8192)
    scaling = [_run(loss_worker, tp, tp, v, tokens) for tp in (1, 2) for v in vocabs]

    print(f"EAGLE3 training step, SmolLM2-135M, seq {seq_len}, draft vocab 8192, "
          f"{psutil.cpu_count()} CPUs, load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} "
          f"(other jobs share these cores: timings are indicative)")
    print(f"{'TP':>3}{'ttt':>5}{'step s':>9}{'rank RSS before MiB':>21}{'rank peak RSS MiB':>19}")
    for r in train:
        print(f"{r['tp']:>3}{r['ttt_steps']:>5}{r['step_seconds']:>9.2f}"
              f"{r['rank_rss_before_mib']:>21.0f}{r['rank_peak_rss_mib']:>19.0f}")
    print(f"\nEAGLE3 loss alone, {tokens} tokens, draft vocab V/4: per-rank peak RSS increase")
    print(f"{'TP':>3}{'V':>8}{'peak +MiB':>11}{'[tokens,V] fp32 MiB':>21}")
    for r in scaling:
        print(f"{r['tp']:>3}{r['vocab']:>8}{r['rank_peak_increase_mib']:>11.0f}"
              f"{r['full_vocab_tensor_mib']:>21.0f}")
    slopes = {}
    for tp in (1, 2):
        rows = [r for r in scaling if r["tp"] == tp]
        x = torch.tensor([r["full_vocab_tensor_mib"] / tp for r in rows], dtype=torch.float64)
        y = torch.tensor([r["rank_peak_increase_mib"] for r in rows], dtype=torch.float64)
        slopes[tp] = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        print(f"TP={tp}: per-rank increase grows {slopes[tp]:.2f} MiB per MiB of a [tokens, V/TP] "
              f"fp32 tensor (equal slopes across TP = scaling as V/TP)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "seq_len": seq_len, "steps": steps,
        "machine": platform.processor() or platform.machine(), "cpus": psutil.cpu_count(),
        "torch": torch.__version__, "load_average_before_after": [load_before, os.getloadavg()],
        "train_step": train, "loss_memory": scaling,
        "loss_memory_slope_per_v_over_tp": slopes,
        "note": "slope: per-rank peak RSS increase per MiB of a [tokens, V/TP] fp32 tensor; "
                "equal across TP means the loss's memory scales as V/TP",
    }, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
