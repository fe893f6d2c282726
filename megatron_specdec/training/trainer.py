"""The freeze-and-train loop: one optimizer step = `global_batch_size` samples through the
pipeline schedule (the base frozen, gradients only in the draft), data-parallel gradient
averaging, global-norm clipping, AdamW on fp32 master weights, the lr schedule as a pure
function of the step.
Checkpoints every `checkpointing.interval` steps and at the end, or at the step where the run's
wall time passes `training.exit_duration_mins` (Megatron's --exit-duration-in-mins), at a
multiple of `training.exit_interval` (Megatron's --exit-interval) or where a
SIGTERM arrived (agreed by all ranks so every rank stops at the same step; a SIGTERM run
writes no final/, the scheduler's grace time being short); the trained model is written
to `<output_dir>/final`: base + draft module as a speculative checkpoint, or a distilled draft
GPT (`draft.algo: draft_model`) alone as a plain GPT checkpoint."""

import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec import distributed
from megatron_specdec.loading.speculative import save_trained, speculative_meta
from megatron_specdec.training import (base_fingerprint, checkpoints, data_fingerprint,
                                       dtype_choice, evaluation, metrics, offline, optimizer,
                                       profiling, schedule)
from megatron_specdec.training.batches import step_batches
from megatron_specdec.training.build import build_speculative
from megatron_specdec.training.recipe import (RecipeError, checkpoint_dir, data_parallel_size,
                                              to_yaml)

log = logging.getLogger(__name__)

FINAL_DIR = "final"


def _resume_point(recipe):
    """The checkpoint to resume from (None: a fresh run). A fresh run never reuses a
    directory that holds checkpoints."""
    directory = checkpoint_dir(recipe)
    if recipe.checkpointing.resume:
        return checkpoints.find_resumable(directory)
    if checkpoints.checkpoints_in(directory):
        raise RecipeError(
            f"recipe key 'checkpointing.resume' is false but {directory} holds checkpoints; "
            f"resume, or choose another checkpointing.directory (nothing is overwritten)")
    return None


def _save_recipe(recipe):
    if dist.get_rank() == 0:
        out = Path(recipe.output_dir)
        name = "recipe.yaml"
        n = 1
        while (out / name).exists():  # every launch's recipe is kept
            name, n = f"recipe.{n}.yaml", n + 1
        (out / name).write_text(to_yaml(recipe))


def _time_is_up(start_time: float, limit_mins: float) -> bool:
    """Whether any rank has passed the wall-time limit (ranks must stop at the same step)."""
    if not limit_mins:
        return False
    return checkpoints.max_over_world(time.time() - start_time) > limit_mins * 60


def _collective_failure(e: RuntimeError) -> bool:
    """A failed collective: torch's distributed errors, or gloo's transport errors (a peer
    that died closes its sockets), which torch raises as a bare RuntimeError."""
    return isinstance(e, dist.DistError) or "gloo/transport" in str(e)


class _Termination:
    """SIGTERM (what Slurm and Kubernetes send before a kill) noted by a handler, acted on
    between steps: the run checkpoints the step it finished and returns. Ranks agree, since a
    scheduler may signal them at different moments. Installed only on the main thread (the
    only one Python delivers signals to); the previous handler comes back on exit."""

    def __init__(self):
        self.received = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame):
        self.received = True
        log.warning("SIGTERM received: checkpointing after this step and stopping")

    def agreed(self) -> bool:
        return checkpoints.max_over_world(float(self.received)) > 0

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@dataclass
class _Run:
    """What the loop and the summary share, built once by `_setup`."""
    model: object
    meta: dict  # the base's checkpoint metadata
    tokenizer: object
    tokenizer_dir: object
    dataset: object
    opt: object
    state: checkpoints.TrainerState
    batches: object
    num_micro: int
    dp: int
    resume_from: object
    ckpt_meta: dict
    reporter: metrics.Reporter


def train(recipe, on_step=None) -> dict:
    """Run (or resume) `recipe` in the current process group; returns the summary.
    `on_step(step)`, if given, is called after each optimizer step (the soak bench samples
    memory and time there, outside the step it measures)."""
    run_start = time.time()  # the time limit counts setup too, as Megatron's does
    run = _setup(recipe)
    start_time, start_step = time.time(), run.state.step
    last, acceptance, stopped = _loop(recipe, run, run_start, on_step)
    final = _save_final(recipe, run, stopped)
    summary = {
        "steps": run.state.step, "steps_this_run": run.state.step - start_step,
        "consumed_samples": run.state.consumed_samples, "scored_tokens": run.state.tokens,
        "seconds_this_run": time.time() - start_time,
        "resumed_from": str(run.resume_from) if run.resume_from else None,
        "final_loss": last.get("loss"), "final_accuracy": last.get("accuracy"),
        "acceptance": acceptance, "final_checkpoint": final and str(final),
        "checkpoints": str(checkpoint_dir(recipe)), "dataset_rows": len(run.dataset),
        "tp": recipe.parallelism.tp, "pp": recipe.parallelism.pp, "dp": run.dp,
        "algo": run.model.spec_config.algo, "mode": recipe.training.mode,
        # steps: training.steps reached; time_limit: exit_duration_mins; exit_interval: a
        # multiple of exit_interval; sigterm: a SIGTERM
        "stopped": stopped,
    }
    run.reporter.close(summary)
    return summary


def _setup(recipe) -> _Run:
    """Process groups, the model (resumed, or built and calibrated), data, optimizer."""
    tp, pp = recipe.parallelism.tp, recipe.parallelism.pp
    distributed.initialize(tp, pp, seed=recipe.training.seed, ep=recipe.parallelism.ep)
    dtype_choice.resolve(recipe)
    dp = data_parallel_size(recipe, dist.get_world_size())
    resume_from = _resume_point(recipe)
    Path(recipe.output_dir).mkdir(parents=True, exist_ok=True)
    _save_recipe(recipe)
    model, hf_config, meta, tokenizer, tokenizer_dir = build_speculative(
        recipe, calibrate=resume_from is None)
    dataset = offline.training_dataset(recipe, model, tokenizer)
    opt = optimizer.DraftOptimizer(model.trainable_parameters(), recipe.optimizer,
                                   checkpoint.dtype_from_name(recipe.model.dtype))
    model.scored_rows_bucket = recipe.data.length_bucket  # few GEMM shapes, as for lengths
    if opt.scaler is not None:  # float16: megatron's schedules scale the loss through this hook
        model.config.grad_scale_func = opt.scale_loss
    base = base_fingerprint.fingerprint(model.base, meta["hf_config"], recipe.model.dtype)
    data = data_fingerprint.fingerprint(recipe.data.train)
    state = checkpoints.TrainerState()
    if resume_from is not None:
        state = checkpoints.load(resume_from, model, opt, base, data)
        log.info("resumed from %s at step %d", resume_from, state.step)
    from megatron_specdec.data import BatchIterator

    mbs = recipe.training.micro_batch_size
    num_micro = recipe.training.global_batch_size // (mbs * dp)
    batches = BatchIterator(dataset, mbs, seed=recipe.data.seed,
                            consumed_samples=state.consumed_samples,
                            data_parallel_rank=ps.get_data_parallel_rank(),
                            data_parallel_size=dp)
    ckpt_meta = speculative_meta(meta, model.spec_config)
    ckpt_meta = dict(ckpt_meta, training_checkpoint={"draft": ckpt_meta.pop("draft"),
                                                     "base_model": recipe.model.path,
                                                     "base": base, "data": data})
    return _Run(model, meta, tokenizer, tokenizer_dir, dataset, opt, state, batches, num_micro,
                dp, resume_from, ckpt_meta, metrics.Reporter(recipe, state.step))


def _loop(recipe, run: _Run, run_start: float, on_step):
    """Optimizer steps until training.steps, the time limit or an agreed SIGTERM, with
    checkpoints and evaluations on their intervals. Returns (the last step's stats, the last
    acceptance measured, why it stopped)."""
    model, opt, state, batches, reporter = run.model, run.opt, run.state, run.batches, \
        run.reporter
    forward_backward = schedule.forward_backward_func(recipe)
    total = recipe.training.steps
    interval = recipe.checkpointing.interval
    last, acceptance, stopped = {}, None, "steps"
    profiler = profiling.StepProfiler(recipe)
    termination = _Termination()
    try:
        while state.step < total:
            profiler.before(state.step)
            lr = optimizer.lr_at(state.step, recipe.optimizer, total)
            micro = step_batches([next(batches) for _ in range(run.num_micro)],
                                 recipe.data.pack, recipe.data.length_bucket)
            opt.zero_grad()
            reports = forward_backward(model, micro)
            grad_norm = opt.step(lr)
            last = metrics.step_stats(reports, metrics.num_draft_steps(model.spec_config))
            state.step += 1
            state.consumed_samples = batches.consumed_samples
            state.tokens += last["tokens"]
            profiler.after(state.step)
            if on_step is not None:
                on_step(state.step)
            reporter.step(state.step, last, lr, grad_norm,
                          recipe.training.global_batch_size * recipe.data.seq_length)
            exit_interval = recipe.training.exit_interval
            if state.step < total:
                if exit_interval and state.step % exit_interval == 0:
                    stopped = "exit_interval"
                elif _time_is_up(run_start, recipe.training.exit_duration_mins):
                    stopped = "time_limit"
                elif termination.agreed():
                    stopped = "sigterm"
            if (interval and state.step % interval == 0) or state.step == total \
                    or stopped != "steps":
                checkpoints.save(checkpoint_dir(recipe), state.step, model, opt, state,
                                 run.ckpt_meta, recipe.checkpointing.keep_last)
            if stopped != "steps":
                log.info("%s at step %d: checkpointed, stopping", stopped, state.step)
                break
            if evaluation.due(recipe, state.step):
                acceptance = evaluation.run(recipe, model, run.tokenizer, state.step, reporter)
    except RuntimeError as e:
        if not _collective_failure(e):
            raise
        raise RuntimeError(
            f"rank {dist.get_rank()}: a collective failed after step {state.step} (another "
            f"rank has probably stopped): {str(e).splitlines()[0] if str(e) else e!r}; "
            f"resume from the newest checkpoint in {checkpoint_dir(recipe)}") from e
    finally:
        termination.close()
    profiler.close(state.step)
    return last, acceptance, stopped


def _save_final(recipe, run: _Run, stopped: str):
    """What the run leaves in output_dir/final (the method's save_trained), or None after a
    SIGTERM: the scheduler's grace time is short, and the checkpoint resumes."""
    if stopped == "sigterm":
        return None
    final = Path(recipe.output_dir) / FINAL_DIR
    state = run.state
    try:
        save_trained(run.model, final, run.meta, run.tokenizer_dir,
                     {"base_model": recipe.model.path, "data": list(recipe.data.train),
                      "steps": state.step, "scored_tokens": state.tokens})
    except checkpoints.WRITE_ERRORS as e:
        raise checkpoint.CheckpointError(
            f"writing the trained model to {final} failed "
            f"({checkpoints.write_failure(e, final)}); the training checkpoint of step "
            f"{state.step} in {checkpoint_dir(recipe)} holds it: rerun the command to "
            f"export again") from e
    return final
