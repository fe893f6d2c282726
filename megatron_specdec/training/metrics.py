"""What a run reports: per-step statistics summed over data parallel and brought to every
rank, and on rank 0 a tqdm bar (tokens/s, loss, per-step accuracy), TensorBoard scalars, an
append-only `train_log.jsonl` (a resumed run appends; the last record of a step wins) and the
final `summary.json`."""

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_specdec import registry
from megatron_specdec.distributed import device
from megatron_specdec.training.schedule import sum_reports

LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "summary.json"


def num_draft_steps(cfg) -> int:
    """Per-step statistics a report holds (the method's loss_steps: EAGLE3 unrolled steps,
    Medusa heads, the one next-token prediction of a draft GPT)."""
    return registry.get(cfg.algo).loss_steps(cfg)


def step_stats(reports, num_steps: int) -> dict:
    """Loss per scored token, per-step loss and top-1 accuracy of one optimizer step, summed
    over micro-batches and data-parallel replicas (the last stage's TP rank 0 contributes)."""
    vec = torch.zeros(2 + 3 * num_steps, dtype=torch.float64, device=device())
    if reports and ps.get_tensor_model_parallel_rank() == 0:
        total = sum_reports(reports)
        vec[0], vec[1] = float(total["loss_sum"]), float(total["num_tokens"])
        for i, key in enumerate(("step_loss", "step_correct", "step_count")):
            vec[2 + i * num_steps: 2 + (i + 1) * num_steps] = total[key].double()
    dist.all_reduce(vec)
    vec = vec.cpu()
    loss_sum, tokens = float(vec[0]), float(vec[1])
    step_loss, correct, count = vec[2:].view(3, num_steps)
    count = count.clamp(min=1)
    return {"loss": loss_sum / max(tokens, 1.0), "tokens": int(tokens),
            "step_loss": (step_loss / count).tolist(), "accuracy": (correct / count).tolist()}


def read_log(output_dir) -> dict:
    """{step: record} of a run's log, the last record of each step winning (resumed runs)."""
    path = Path(output_dir) / LOG_FILE
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if "step" in rec and "loss" in rec:
                    records[rec["step"]] = rec
    return records


class Reporter:
    """Rank 0's outputs; on other ranks every method does nothing."""

    def __init__(self, recipe, start_step: int):
        self.active = dist.get_rank() == 0
        self.recipe = recipe
        self.out = Path(recipe.output_dir)
        self.interval = recipe.logging.interval
        self.bar = self.tb = self.log = None
        self.start = time.time()
        self.window = (time.time(), 0)
        if not self.active:
            return
        self.log = open(self.out / LOG_FILE, "a")
        self.event({"event": "start" if start_step == 0 else "resume", "step": start_step})
        if recipe.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out / "tensorboard"), purge_step=start_step + 1)
        if recipe.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=recipe.training.steps, initial=start_step, unit="step",
                            dynamic_ncols=True)

    def event(self, record: dict):
        if self.active:
            self.log.write(json.dumps(dict(record, time=time.time())) + "\n")
            self.log.flush()

    def step(self, step: int, stats: dict, lr: float, grad_norm: float, input_tokens: int):
        if not self.active:
            return
        t0, n0 = self.window
        now, n = time.time(), n0 + input_tokens
        tokens_per_s = n / max(now - t0, 1e-9)
        if step % self.interval == 0 or step == self.recipe.training.steps:
            self.event(dict(stats, step=step, lr=lr, grad_norm=grad_norm,
                            tokens_per_s=tokens_per_s))
            if self.tb is not None:
                self.tb.add_scalar("train/loss", stats["loss"], step)
                self.tb.add_scalar("train/lr", lr, step)
                self.tb.add_scalar("train/grad_norm", grad_norm, step)
                self.tb.add_scalar("train/tokens_per_s", tokens_per_s, step)
                for k, (loss, acc) in enumerate(zip(stats["step_loss"], stats["accuracy"])):
                    self.tb.add_scalar(f"train/step{k}_loss", loss, step)
                    self.tb.add_scalar(f"train/step{k}_accuracy", acc, step)
            self.window = (now, 0)
        else:
            self.window = (t0, n)
        if self.bar is not None:
            acc = "/".join(f"{a:.2f}" for a in stats["accuracy"][:4])
            self.bar.set_postfix_str(f"loss {stats['loss']:.3f} acc {acc} tok/s {tokens_per_s:.0f}")
            self.bar.update(1)

    def scalar(self, name: str, value: float, step: int):
        if self.active and self.tb is not None:
            self.tb.add_scalar(name, value, step)

    def close(self, summary: dict):
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.event({"event": "end", "step": summary["steps"]})
        self.log.close()
        tmp = self.out / f".{SUMMARY_FILE}.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(self.out / SUMMARY_FILE)
