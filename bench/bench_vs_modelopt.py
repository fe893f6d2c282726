"""Side by side with NVIDIA ModelOpt: the shipped EAGLE3 recipe and ModelOpt's HF EAGLE3 trainer,
each given the same wall time on this machine, their drafts measured the same way.

    python bench/bench_vs_modelopt.py --minutes 45 --out bench/results/vs_modelopt.json

Phases (a finished one is skipped on rerun; everything goes under --work-dir):
  0. env: a venv at --modelopt-env (default runs/venv-modelopt) made from .venv's base
     interpreter without pip, whose site-packages holds a .pth that adds .venv's site-packages
     (so torch, accelerate, safetensors... are .venv's: no second torch is downloaded and .venv
     is never changed), then `pip install --no-deps -r bench/modelopt_requirements.txt` into it:
     ModelOpt 0.47.0, the small packages .venv lacks, and transformers 5.14.1 (ModelOpt's [hf]
     extra wants <5.15: with .venv's 5.23 its EAGLE module fails building LlamaRotaryEmbedding)
     with its tokenizers and huggingface-hub; the env's own packages shadow .venv's. Reinstalled
     when the requirements file changes.
  1. modelopt: SmolLM2-135M-Instruct (the embedded model's HF directory) as a transformers model
     in bfloat16, `mtsp.convert(model, [("eagle", cfg)])` with ModelOpt's EAGLE3_DEFAULT_CFG
     except that the draft layer takes the base's shape (MLP width, heads, head_dim, rope_theta,
     norm eps: the importer builds the draft from the base's layer) and an 8192-token draft
     vocabulary (ModelOpt's d2t buffer, filled with the recipe's calibration of the same data);
     torch.compile off (on 2 cores it costs minutes of the budget). Trained with the HF Trainer
     on the recipe's data (one conversation per 512-token row, padded: ModelOpt's HF path does
     not pack; loss on assistant tokens), 8 rows a step, lr 1e-3 cosine with the recipe's
     warmup, the Trainer's defaults otherwise (AdamW, max_grad_norm 1.0, the cosine to 0),
     until --minutes of wall time from process start (a TrainerCallback) or --modelopt-steps;
     exported with ModelOpt's export_speculative_decoding (the layout vLLM loads: one layer as
     `layers.0.*`, d2t without t2d).
  2. project: `python -m megatron_specdec.cli.train --config recipes/eagle3_smollm2.yaml` online
     (the base forward paid each step, as on the ModelOpt side) with
     training.exit_duration_mins=--minutes and training.steps=--project-steps, then
     checkpoint_tools/export_draft.py.
  3. eval: both HF drafts imported onto one bfloat16 base checkpoint (checkpoint_tools/
     import_draft.py) and measured by megatron_specdec.cli.validate on the same prompts
     (fixed chains of 7 drafts, greedy): acceptance length overall and per category.
The steps of each side (--modelopt-steps, --project-steps) set where its cosine ends: choose
them from each trainer's s/step on the idle machine (the JSON records it) so both decay by the
deadline. Writes --out (JSON) and prints a table. Run it on an idle machine: the load average
before and after each phase is recorded.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "eagle3_smollm2.yaml"
SIDES = ("modelopt", "project")
REQUIREMENTS = REPO / "bench" / "modelopt_requirements.txt"
TRAIN_JSON = "train.json"  # phase 1's output, written inside the ModelOpt env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=45.0, help="wall time of each trainer")
    p.add_argument("--out", default="bench/results/vs_modelopt.json", help="result JSON")
    p.add_argument("--work-dir", default="runs/vs_modelopt", help="outputs of every phase")
    p.add_argument("--modelopt-env", default="runs/venv-modelopt",
                   help="venv that holds ModelOpt (made by phase 0 if absent)")
    p.add_argument("--modelopt-steps", type=int, default=340,
                   help="ModelOpt's max_steps: the end of its cosine (default: 45 min at ~8 s)")
    p.add_argument("--project-steps", type=int, default=240,
                   help="training.steps: the end of the recipe's cosine (45 min at ~11 s, "
                   "online bf16 on the idle 2-core CPU)")
    p.add_argument("--prompts", default="bench/mt_bench_3per_category.jsonl")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts (default all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=7)
    p.add_argument("--modelopt-worker", action="store_true",
                   help=argparse.SUPPRESS)  # phase 1 itself, run inside the ModelOpt env
    return p.parse_args(argv)


def _run(cmd, log_path, python=sys.executable):
    """Run a phase's command from the repo root, its output to `log_path`; fail naming both."""
    cmd = [str(python)] + [str(c) for c in cmd]
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        code = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"bench_vs_modelopt: `{' '.join(cmd[1:4])} ...` exited {code}; see {log_path}")


def _timed(result_path, fn):
    """`fn()`'s dict with wall minutes and load averages, saved to `result_path` (the phase's
    done mark), or the saved one."""
    result_path = Path(result_path)
    if result_path.is_file():
        print(f"[skip] {result_path} exists")
        return json.loads(result_path.read_text())
    load_before, start = os.getloadavg(), time.time()
    result = dict(fn(), wall_minutes=(time.time() - start) / 60, load_before=load_before,
                  load_after=os.getloadavg())
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(result, indent=2))
    return result


# Phase 0 ----------------------------------------------------------------------------------

def modelopt_python(env: Path) -> Path:
    """The env's interpreter, (re)installed when its stamp differs from the requirements."""
    python, stamp = env / "bin" / "python", env / "bench-requirements.txt"
    wanted = REQUIREMENTS.read_text()
    if python.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    import site

    if not python.is_file():
        print(f"[env] creating {env}")
        base_python = getattr(sys, "_base_executable", sys.executable)
        subprocess.check_call([base_python, "-m", "venv", "--without-pip", str(env)])
        purelib = subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True).strip()
        (Path(purelib) / "_main_venv.pth").write_text(
            f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n")
    subprocess.check_call([str(python), "-m", "pip", "install", "--no-deps", "-r",
                           str(REQUIREMENTS)])
    subprocess.check_call([str(python), "-c", "import modelopt.torch.speculative"])
    stamp.write_text(wanted)
    return python


# Phase 1 (runs in the ModelOpt env) ------------------------------------------------------

def _recipe():
    from megatron_specdec.training.recipe import load_recipe

    return load_recipe(RECIPE, ["output_dir=unused"])


def modelopt_train(args, out: Path) -> dict:
    start = time.time()  # the limit counts setup, as training.exit_duration_mins does
    import copy

    import torch
    import transformers
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG

    import modelopt
    import modelopt.torch.speculative as mtsp
    from megatron_specdec.data import ConversationDataset, calibrate
    from megatron_specdec.models.default_model import default_model_dir

    recipe = _recipe()
    hf_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    base = model.config
    theta = (getattr(base, "rope_parameters", None) or {}).get("rope_theta") or base.rope_theta
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    vocab_size = recipe.draft.config["draft_vocab_size"]
    cfg["eagle_architecture_config"].update(
        intermediate_size=base.intermediate_size, num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads,
        head_dim=getattr(base, "head_dim", None) or base.hidden_size // base.num_attention_heads,
        rms_norm_eps=base.rms_norm_eps,
        rope_theta=theta, rope_scaling={"rope_type": "default", "rope_theta": theta},
        draft_vocab_size=vocab_size)
    cfg["eagle_use_torch_compile"] = False
    mtsp.convert(model, [("eagle", cfg)])
    seq = recipe.data.seq_length
    vocab = calibrate(recipe.data.train, tokenizer, vocab_size, max_length=seq)
    d2t = model.eagle_module.d2t
    if d2t.shape != vocab.d2t.shape:
        raise ValueError(f"ModelOpt's d2t {tuple(d2t.shape)} != the calibrated "
                         f"{tuple(vocab.d2t.shape)}")
    d2t.copy_(vocab.d2t)
    rows = ConversationDataset.from_files(recipe.data.train, tokenizer, seq, pack=False,
                                          on_error=recipe.data.on_error)
    seen = {"tokens": 0, "loss_tokens": 0}

    class Rows(torch.utils.data.Dataset):
        """One padded conversation a row, as ModelOpt's HF data path feeds its trainer."""

        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            row = rows[i]
            return {"input_ids": row["input_ids"],
                    "attention_mask": (row["segment_ids"] > 0).long(),
                    "loss_mask": row["loss_mask"].to(torch.bfloat16)}

    class CountingTrainer(transformers.Trainer):
        """Counts the tokens its steps consume (the data loader fetches a batch ahead)."""

        def compute_loss(self, model, inputs, *a, **kw):
            seen["tokens"] += int(inputs["attention_mask"].sum())
            seen["loss_tokens"] += int(inputs["loss_mask"].sum())
            return super().compute_loss(model, inputs, *a, **kw)

    class TimeLimit(transformers.TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if time.time() - start > args.minutes * 60:
                control.should_training_stop = True
                self.stopped = "time_limit"

    limit = TimeLimit()
    limit.stopped = "steps"
    targs = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=True,
        per_device_train_batch_size=recipe.training.global_batch_size,
        gradient_accumulation_steps=1, max_steps=args.modelopt_steps,
        learning_rate=recipe.optimizer.lr, lr_scheduler_type="cosine",
        warmup_steps=recipe.optimizer.warmup_steps, weight_decay=0.0,
        save_strategy="no", logging_steps=10, report_to="none", remove_unused_columns=False,
        dataloader_num_workers=0, seed=recipe.training.seed, disable_tqdm=True)
    trainer = CountingTrainer(model=model, args=targs, train_dataset=Rows(), callbacks=[limit])
    train_start = time.time()
    output = trainer.train()
    train_seconds = time.time() - train_start
    export_speculative_decoding(model, dtype=torch.bfloat16, export_dir=out / "export")
    # ModelOpt 0.47 writes its template's YaRN rope_scaling into the export whatever the draft
    # was trained with; this draft trained with the base's plain RoPE (cfg above), and the
    # importer refuses a scaling that differs from the base's, so the config says what was used.
    config_path = out / "export" / "config.json"
    exported = json.loads(config_path.read_text())
    export_fix = {"rope_scaling": [exported.get("rope_scaling"), None]}
    exported["rope_scaling"] = None
    config_path.write_text(json.dumps(exported, indent=2))
    steps = trainer.state.global_step
    positions = steps * recipe.training.global_batch_size * seq
    return {
        "modelopt_version": modelopt.__version__, "transformers": transformers.__version__,
        "steps": steps, "stopped": limit.stopped,
        "mean_loss": output.training_loss,  # the Trainer's mean over the run
        "rows": len(rows), "seq_length": seq, "positions": positions,
        "tokens_seen": seen["tokens"],
        "loss_tokens_seen": seen["loss_tokens"],  # assistant tokens (the loss mask) of its rows
        "train_seconds": train_seconds, "seconds_from_start": time.time() - start,
        "positions_per_s": positions / train_seconds,
        "loss_tokens_per_s": seen["loss_tokens"] / train_seconds,
        "s_per_step": train_seconds / max(steps, 1),
        "eagle_config": {k: v for k, v in cfg.items() if k != "eagle_architecture_config"},
        "eagle_architecture_config": cfg["eagle_architecture_config"],
        "draft_vocab_size": vocab_size, "log": trainer.state.log_history[-3:],
        "export_config_fix": export_fix,
    }


# Phase 2 -----------------------------------------------------------------------------------

def project_train(args, work: Path) -> dict:
    out = work / "project"
    log = work / "project.log"
    start = time.time()
    _run(["-m", "megatron_specdec.cli.train", "--config", RECIPE, f"output_dir={out}",
          "training.mode=online", f"training.exit_duration_mins={args.minutes}",
          f"training.steps={args.project_steps}", "evaluation.interval=0",
          "logging.progress_bar=false"], log)
    train_seconds = time.time() - start
    _run(["checkpoint_tools/export_draft.py", "--model", out / "final", "--out", out / "export",
          "--dtype", "bfloat16", "--overwrite"], log)
    summary = json.loads((out / "summary.json").read_text())
    recipe = _recipe()
    steps, seconds = summary["steps_this_run"], summary["seconds_this_run"]
    positions = steps * recipe.training.global_batch_size * recipe.data.seq_length
    return {"steps": summary["steps"], "stopped": summary["stopped"],
            "final_loss": summary["final_loss"], "rows": summary["dataset_rows"],
            "seq_length": recipe.data.seq_length, "positions": positions,
            "tokens_seen": None,  # packed rows: all but each row's tail are tokens
            "loss_tokens_seen": summary["scored_tokens"],  # the trainer's scored_tokens
            "train_seconds": seconds, "seconds_from_start": train_seconds,
            "positions_per_s": positions / seconds,
            "loss_tokens_per_s": summary["scored_tokens"] / seconds,
            "s_per_step": seconds / max(steps, 1)}


# Phase 3 -----------------------------------------------------------------------------------

def evaluate(args, work: Path, side: str, draft: Path) -> dict:
    base = work / "base"
    log = work / "eval.log"
    if not (work / "base.done").is_file():
        _run(["checkpoint_tools/hf_to_megatron.py", "--model", "default", "--out", base,
              "--dtype", "bfloat16", "--overwrite"], log)
        (work / "base.done").touch()
    ckpt, out = work / "eval" / side / "ckpt", work / "eval" / side
    _run(["checkpoint_tools/import_draft.py", "--draft", draft, "--model", base,
          "--out", ckpt, "--overwrite"], log)
    cmd = ["-m", "megatron_specdec.cli.validate", "--model", ckpt, "--data", args.prompts,
           "--out", out, "--max-new-tokens", args.max_new_tokens, "--num-draft-tokens",
           args.num_draft_tokens, "--draft-policy", "fixed", "--no-greedy"]
    if args.num_prompts:
        cmd += ["--num-prompts", args.num_prompts]
    _run(cmd, log)
    report = json.loads((out / "acceptance.json").read_text())
    return {"acceptance_length": report["overall"]["acceptance_length"],
            "categories": {c: s["acceptance_length"] for c, s in report["categories"].items()},
            "prompts": len(report.get("per_prompt", [])) or args.num_prompts}


# ------------------------------------------------------------------------------------------

def _machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def _table(result: dict) -> str:
    rows = [("", *SIDES)]
    show = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
    for part, key, fmt in (
            ("eval", "acceptance_length", "{:.3f}"), ("train", "steps", "{}"),
            ("train", "stopped", "{}"), ("train", "positions", "{:,}"),
            ("train", "tokens_seen", "{:,}"), ("train", "loss_tokens_seen", "{:,}"),
            ("train", "positions_per_s", "{:.1f}"), ("train", "loss_tokens_per_s", "{:.1f}"),
            ("train", "s_per_step", "{:.2f}"), ("train", "wall_minutes", "{:.1f}")):
        rows.append((key, *(show(result[s][part][key], fmt) for s in SIDES)))
    for c in sorted(result["project"]["eval"]["categories"]):
        rows.append((f"  AL {c}", *(show(result[s]["eval"]["categories"].get(c), "{:.2f}")
                                    for s in SIDES)))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, width)) for r in rows)


def main(argv=None):
    from megatron_specdec.cli.common import setup_logging

    setup_logging()  # the benign megatron-core warnings stay out of the bench's output
    args = parse_args(argv)
    work = (REPO / args.work_dir).resolve()
    if args.modelopt_worker:
        out = work / "modelopt"
        out.mkdir(parents=True, exist_ok=True)
        (out / TRAIN_JSON).write_text(json.dumps(modelopt_train(args, out), indent=2))
        return
    work.mkdir(parents=True, exist_ok=True)
    if args.minutes <= 0:
        sys.exit(f"--minutes must be > 0, got {args.minutes}")
    python = modelopt_python((REPO / args.modelopt_env).resolve())
    from megatron_specdec.models.default_model import default_model_dir

    default_model_dir()  # materialised by the project's transformers, not the ModelOpt env's
    forwarded = ["--minutes", args.minutes, "--work-dir", work,
                 "--modelopt-steps", args.modelopt_steps]

    def phase1():
        _run([Path(__file__).resolve(), *forwarded, "--modelopt-worker"], work / "modelopt.log",
             python=python)
        return json.loads((work / "modelopt" / TRAIN_JSON).read_text())

    result = {"minutes": args.minutes, "machine": _machine(), "load_at_start": os.getloadavg()}
    trained = {"modelopt": _timed(work / "modelopt" / "result.json", phase1),
               "project": _timed(work / "project" / "result.json",
                                 lambda: project_train(args, work))}
    drafts = {"modelopt": work / "modelopt" / "export", "project": work / "project" / "export"}
    for side in SIDES:
        result[side] = {"train": trained[side],
                        "eval": _timed(work / "eval" / side / "result.json",
                                       lambda s=side: evaluate(args, work, s, drafts[s]))}
    result["eval"] = {"prompts": args.prompts, "num_prompts": args.num_prompts,
                      "max_new_tokens": args.max_new_tokens,
                      "num_draft_tokens": args.num_draft_tokens, "draft_policy": "fixed"}
    result["load_at_end"] = os.getloadavg()
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(_table(result))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
