"""Supervised fine-tuning of a causal LM on chat prompt/completion pairs with TRL's SFTTrainer.

One recipe for both models that are fine-tuned: the experience model (task, history, state, action, retrieved
examples -> reasoning, next state, reward, done) and the policy's warm start (conversation so far -> next action).
LoRA by default (optionally only on the top layers: backpropagation then stops there, most of a CPU step's cost),
full fine-tuning when `lora` is None. Checkpoints resume; a finished run saves a model `load_trained_model` reads.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from components import distributed
from components.files import atomic_directory, discard_unless_stamped, write_made_from

if TYPE_CHECKING:  # heavy imports happen inside the functions that need them
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA section of params.yaml (`*.lora`): no defaults here, every value comes from params."""

    r: int
    alpha: int
    dropout: float
    # "all-linear": every linear layer but the output head, i.e. the attention and MLP projections of any
    # architecture (q/k/v/o, gate/up/down for Llama-style models), without listing module names per model.
    target_modules: str | tuple[str, ...]
    # Adapt only the top N transformer layers (None: all). Backpropagation then stops N layers down, which is most
    # of the cost of a step on CPU; the lower layers keep their pretrained features.
    top_layers: int | None


@dataclass(frozen=True)
class TrainingSettings:
    """An SFT section of params.yaml (experience_model.training, policy.sft.training) plus the run seed; no defaults
    here, every value comes from params."""

    epochs: float
    max_steps: int  # > 0 overrides epochs (smoke runs, fixed budgets)
    learning_rate: float
    batch_size: int
    gradient_accumulation_steps: int
    max_seq_len: int  # longer examples are left out (counted), never cut: a cut target teaches broken replies
    lora: LoraSettings | None  # None: full fine-tuning
    merge_lora: bool  # save a plain model (loads anywhere, vLLM included) instead of an adapter
    # "auto": bf16 autocast where the hardware has bf16 matrix units (recent GPUs; CPUs with AMX or AVX512-BF16),
    # else fp32. Forcing bf16 on a CPU without them is ~10-40x slower than fp32 (it is emulated).
    precision: Literal["auto", "fp32", "bf16"]
    # Recompute activations in the backward pass: ~30% more compute for much less memory (SmolLM2-135M, batch 4 of
    # ~1,300 tokens, LoRA on all layers, fp32: 21 GB peak without it; LoRA on the top 8 layers: 9 GB).
    activation_checkpointing: bool
    warmup: float  # a ratio of total steps (< 1) or a number of steps
    logging_steps: int
    save_steps: int
    save_total_limit: int
    seed: int




def token_lengths(dataset: Dataset, tokenizer: PreTrainedTokenizerBase) -> list[tuple[int, int]]:
    """(prompt tokens, completion tokens) per example, as SFTTrainer will see them (for max_seq_len and reports)."""
    lengths = []
    for row in dataset:
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
        n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        lengths.append((n_prompt, len(tokenizer(full, add_special_tokens=False)["input_ids"]) - n_prompt))
    return lengths




@dataclass(frozen=True)
class TrainingResult:
    model_dir: Path  # loads with load_trained_model (a plain model, or an adapter when merge_lora is off)
    global_step: int
    examples: int  # trained on
    too_long: int  # left out: longer than max_seq_len tokens
    train_loss: float | None  # mean of the logged losses over the whole run, resumed steps included
    final_loss: float | None  # the last logged loss
    resumed_from: str | None
    seconds: float  # training time over every invocation of the run, resumed ones included
    # What it trained in and on: the same seed trains the same model on one machine, not on another whose "auto"
    # precision or kernels differ, so a run's record says which it was.
    precision: Literal["fp32", "bf16"]
    hardware: str

    def summary(self) -> str:
        """The run's losses, time and machine, for a report."""
        losses = (f"training loss {self.train_loss:.4f} on average, {self.final_loss:.4f} at the last logged step"
                  if self.train_loss is not None else "no training loss logged")
        resumed = f", resumed from `{Path(self.resumed_from).name}`" if self.resumed_from else ""
        return f"{losses}, {self.seconds:.0f} s in {self.precision} on {self.hardware}{resumed}"


SECONDS_FILE = "training_seconds.txt"  # in each checkpoint: the training time up to it, earlier invocations included
TRAINED_ON_FILE = "trained_on.json"  # in each checkpoint: its precision and hardware, which a restored one reports


@dataclass(frozen=True)
class Emphasis:
    """Target words whose token weighs `weight` times the others in the loss. Why: a decision one token carries
    (the experience model's verdict on a command) is a few hundredths of a loss averaged over the hundreds of
    next-state tokens around it."""

    words: tuple[str, ...]
    weight: float

    def token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The token of each word as it stands in running text (after a space). ValueError for a word the tokenizer
        splits: weighing its first piece would weigh every other word that starts with it."""
        ids = []
        for word in self.words:
            pieces = tokenizer.encode(f" {word}", add_special_tokens=False)
            if len(pieces) != 1:
                raise ValueError(f"' {word}' is {len(pieces)} tokens for this tokenizer "
                                 f"({[tokenizer.decode([piece]) for piece in pieces]}), so its loss weight would "
                                 "fall on pieces other words share: set experience_model.verdict_weight to 1 for "
                                 "this model")
            ids += pieces
        return sorted(ids)


def weighted_trainer(token_ids: list[int], weight: float) -> Any:
    """An SFTTrainer class whose loss weighs the target tokens in `token_ids` `weight` times the others: TRL's own
    per-token log-probabilities (its fused LM head, no full logits), summed with the weights and divided by the
    batch's target tokens, as TRL divides its loss (so the weights also raise the gradient's scale a little). At
    weight 1 it is TRL's loss; the logged loss is the weighted one. It logs no entropy, token accuracy or token count
    (TRL's compute_loss does)."""
    import torch
    from trl import SFTTrainer

    class WeightedSFTTrainer(SFTTrainer):
        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            outputs = model(**{**inputs, "use_cache": False}, fused_lm_head=True)
            # log_probs[:, t] scores token t + 1, or shift_labels[:, t] where a context-parallel run passes them
            target = inputs.get("shift_labels", inputs["labels"][:, 1:]).to(outputs.log_probs.device)
            emphasized = torch.isin(target, torch.tensor(token_ids, device=target.device))
            tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = (-outputs.log_probs * torch.where(emphasized, weight, 1.0)).sum() / torch.as_tensor(
                tokens).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:  # as TRL's compute_loss
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            return (loss, outputs) if return_outputs else loss

    return WeightedSFTTrainer


def train_sft(
    dataset: Dataset,
    base_model: str,
    output_dir: str | Path,
    settings: TrainingSettings,
    cache_dir: str | Path = ".cache/models",
    emphasis: Emphasis | None = None,
    kept: str | Path | None = None,
) -> TrainingResult:
    """SFT `base_model` (packaged alias, hub id or local path) on `dataset` with TRL's SFTTrainer (`emphasis`: target
    words the loss weighs more, `weighted_trainer`).

    Layout: `output_dir/checkpoints/` holds the trainer's checkpoints; a rerun with the same data and settings resumes
    from the last one (a stopped job loses at most `save_steps` steps), and a rerun with different data or settings
    starts over. `output_dir/model/` is the result, written only once training finished.

    `kept`: a folder of finished LoRA trainings by fingerprint (`keep_training`). One with this run's data and
    settings is restored as its last checkpoint instead of trained again; a LoRA training that finishes is kept there.
    """
    import torch
    from transformers.trainer_utils import get_last_checkpoint
    from trl import SFTConfig, SFTTrainer

    from components.llm.models import CHATML_TEMPLATE, load_causal_lm, resolve_model

    output_dir = Path(output_dir)
    checkpoints = output_dir / "checkpoints"
    dataset = dataset.select_columns(["prompt", "completion"])
    # Resuming is only correct for the same data and settings; anything else starts from the base model.
    emphasis = emphasis if emphasis is not None and emphasis.weight != 1 else None
    fingerprint = _fingerprint(dataset, base_model, settings, emphasis)
    with distributed.main_process_first():  # one process cleans up and converts a packaged model; the rest wait
        if distributed.is_main_process() and discard_unless_stamped(checkpoints, fingerprint,
                                                                   checkpoints / "fingerprint.txt"):
            log.info("checkpoints in %s were for other data or settings: starting over", checkpoints)
        base_path = resolve_model(base_model, cache_dir)
        if distributed.is_main_process() and kept is not None and settings.lora is not None:
            restore_training(kept, fingerprint, checkpoints, base_path)
        # fp32 master weights even for bf16: autocast computes in bf16 and the optimizer updates in full precision.
        model, tokenizer = load_causal_lm(base_model, cache_dir=cache_dir, dtype="float32")  # this process's device
    if tokenizer.chat_template is None:  # a base model: give it ChatML, saved with the tokenizer for inference
        tokenizer.chat_template = CHATML_TEMPLATE
    fits = [i for i, (p, c) in enumerate(token_lengths(dataset, tokenizer)) if p + c <= settings.max_seq_len]
    too_long = len(dataset) - len(fits)
    if too_long:
        log.warning("%d of %d examples exceed max_seq_len=%d tokens and are left out", too_long, len(dataset),
                    settings.max_seq_len)
        dataset = dataset.select(fits)
    if not fits:
        raise ValueError(f"no example fits in max_seq_len={settings.max_seq_len} tokens: raise it or shorten prompts")
    resume = get_last_checkpoint(str(checkpoints)) if checkpoints.is_dir() else None
    state = json.loads((Path(resume) / "trainer_state.json").read_text()) if resume else {}
    if resume and state["global_step"] >= state["max_steps"] > 0:  # the plan is part of the checkpoints' fingerprint
        # Nothing left to train. Trainer.train would still take a step: resumed mid-epoch, it tests max_steps only
        # after one (a finished 6-step run came back with 7). The checkpoint is the trained model.
        log.info("%s finished the run: nothing left to train", resume)
        trained, tokenizer = load_trained_model(resume)
        model_dir = _save_model(trained, tokenizer, output_dir, settings, fingerprint)
        _keep(kept, checkpoints, fingerprint, base_model, base_path, settings)
        precision, machine = _trained_on(resume) or (resolve_precision(settings.precision), hardware())
        return TrainingResult(model_dir, state["global_step"], len(dataset), too_long, *_losses(state["log_history"]),
                              resume, _seconds_until(resume), precision, machine)

    args = SFTConfig(
        output_dir=str(checkpoints),
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size,
        gradient_accumulation_steps=distributed.per_process_accumulation(settings.gradient_accumulation_steps),
        learning_rate=settings.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=settings.warmup,
        max_length=settings.max_seq_len,
        completion_only_loss=True,
        bf16=resolve_precision(settings.precision) == "bf16",
        use_cpu=not torch.cuda.is_available(),  # transformers refuses bf16 without a GPU unless told it is a CPU
        activation_checkpointing=settings.activation_checkpointing,  # TRL's default is on: we choose explicitly
        dataloader_pin_memory=torch.cuda.is_available(),
        logging_steps=settings.logging_steps,
        save_strategy="steps",
        save_steps=settings.save_steps,
        save_total_limit=settings.save_total_limit,
        seed=settings.seed,
        data_seed=settings.seed,
        report_to="none",
        disable_tqdm=True,  # _progress_log writes step, loss and ETA as log lines (readable in DVC and Prefect logs)
    )
    peft_config = lora_config(model, settings.lora) if settings.lora is not None else None
    emphasized = emphasis.token_ids(tokenizer) if emphasis else []
    trainer_class = weighted_trainer(emphasized, emphasis.weight) if emphasis else SFTTrainer
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[progress := _progress_log(_seconds_until(resume), resolve_precision(settings.precision))],
    )

    if emphasis:  # say what the weight falls on: teacher-written traces may not use the words at all
        wanted = set(emphasized)
        found = sum(token in wanted for row in trainer.train_dataset for token in row["labels"])
        (log.info if found else log.warning)("%d target tokens of %d examples are %s, weighing %g times the others%s",
                                             found, len(trainer.train_dataset), "/".join(emphasis.words),
                                             emphasis.weight, "" if found else ": the weight changes nothing")
    if resume:
        log.info("resuming from %s", resume)
    trainer.train(resume_from_checkpoint=resume)
    model_dir = _save_model(trainer.model, tokenizer, output_dir, settings, fingerprint)
    _keep(kept, checkpoints, fingerprint, base_model, base_path, settings)
    return TrainingResult(model_dir, trainer.state.global_step, len(dataset), too_long,
                          *_losses(trainer.state.log_history), resume, progress.seconds(),
                          resolve_precision(settings.precision), hardware())


# What only continuing a training needs: a kept training is finished, so it leaves them out (most of a checkpoint).
TRAINING_STATE = ("optimizer.pt", "scheduler.pt", "scaler.pt", "training_args.bin", "rng_state")
# Files a checkpoint may share with its base model: kept only where they differ, restored from the base model.
SHARED_WITH_BASE = ("tokenizer.json",)


def keep_training(checkpoints: str | Path, kept: str | Path, fingerprint: str, base_model: str,
                  base_path: str | Path) -> Path | None:
    """Copy the last checkpoint of a finished LoRA training in `checkpoints` into `kept/<fingerprint[:16]>/`, once:
    the adapter, tokenizer, trainer state (its losses) and training time, not what only continuing it needs
    (TRAINING_STATE) nor a file the base model (at `base_path`) has byte for byte (its tokenizer.json, most of what
    is left), with `fingerprint.txt` and the base model as params name it (no machine's path). Why: DVC's
    cache holds the merged model (hundreds of MB) on one machine; the adapter (a few MB) can travel with the
    repository, so another machine, or a later row of a study, starts from the same model instead of training another.
    Returns the kept folder, or None where `checkpoints` holds no checkpoint."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(checkpoints)) if Path(checkpoints).is_dir() else None
    target = Path(kept) / fingerprint[:16]
    if last is None:
        return None
    if (target / "fingerprint.txt").is_file():
        return target  # kept before: the same data and settings
    with atomic_directory(target) as partial:
        copy = partial / Path(last).name
        base = Path(base_path)
        shutil.copytree(last, copy, ignore=lambda folder, names: [
            name for name in names if name.startswith(TRAINING_STATE) or _same_file(Path(folder, name), base / name)])
        _set_base_model(copy, base_model)
        (partial / "fingerprint.txt").write_text(fingerprint + "\n", encoding="utf-8")
    log.info("kept the finished training %s in %s", Path(last).name, target)
    return target


def kept_training(kept: str | Path, fingerprint: str) -> Path | None:
    """The folder `keep_training` kept the training with `fingerprint` in, or None where `kept` holds none."""
    source = Path(kept) / fingerprint[:16]
    stamp = source / "fingerprint.txt"
    return source if stamp.is_file() and stamp.read_text(encoding="utf-8").strip() == fingerprint else None


def restore_training(kept: str | Path, fingerprint: str, checkpoints: str | Path, base_path: str) -> str | None:
    """The training kept under `fingerprint` (`keep_training`) as the last checkpoint in `checkpoints`, its adapter
    pointing at `base_path` (the base model on this machine) and the files it shares with that model copied from
    there, where `checkpoints` holds none; its path, or None."""
    from transformers.trainer_utils import get_last_checkpoint

    source = kept_training(kept, fingerprint)
    if source is None:
        return None
    checkpoints = Path(checkpoints)
    if get_last_checkpoint(str(checkpoints)) if checkpoints.is_dir() else None:
        return None  # this run's own checkpoints come first
    [saved] = [path for path in source.iterdir() if path.is_dir()]
    partial = checkpoints / f"{saved.name}.partial"  # not a checkpoint's name: a half copy is never the last one
    shutil.copytree(saved, partial, dirs_exist_ok=True)
    for name in SHARED_WITH_BASE:
        if not (partial / name).exists() and (Path(base_path) / name).is_file():
            shutil.copy2(Path(base_path) / name, partial / name)
    _set_base_model(partial, base_path)
    target = partial.rename(checkpoints / saved.name)
    log.info("restored the finished training kept in %s: nothing to train", source)
    return str(target)


def _set_base_model(checkpoint: Path, base_model: str) -> None:
    """Point the adapter in `checkpoint` at `base_model` (a name as params give it, or a path on this machine)."""
    path = checkpoint / "adapter_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, "base_model_name_or_path": base_model}, indent=2, sort_keys=True) + "\n",
                    encoding="utf-8")


def _same_file(path: Path, other: Path) -> bool:
    return path.name in SHARED_WITH_BASE and other.is_file() and path.read_bytes() == other.read_bytes()


def _keep(kept: str | Path | None, checkpoints: Path, fingerprint: str, base_model: str, base_path: str,
          settings: TrainingSettings) -> None:
    if kept is None or not distributed.is_main_process():
        return
    if settings.lora is None:  # a full fine-tune's checkpoint is the whole model: not what the folder is for
        log.info("not kept in %s: only LoRA trainings are (this one fine-tuned every weight)", kept)
        return
    keep_training(checkpoints, kept, fingerprint, base_model, base_path)


def _losses(log_history: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Mean and last of the logged training losses. From the log, not Trainer's `train_loss`: that one averages
    only the steps of the last invocation, so a resumed (or already finished) run would report another number."""
    losses = [entry["loss"] for entry in log_history if "loss" in entry]
    return (sum(losses) / len(losses), losses[-1]) if losses else (None, None)


def _save_model(trained: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, output_dir: Path,
                settings: TrainingSettings, fingerprint: str) -> Path:
    """The trained model at output_dir/model, saying the training's `fingerprint` made it (`directory_identity`),
    written by the main process (the others wait until it is there)."""
    model_dir = output_dir / "model"
    if distributed.is_main_process():
        if settings.lora is not None and settings.merge_lora:
            trained = trained.merge_and_unload()
        tmp = output_dir / ".model.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        save_for_inference(trained, tokenizer, tmp)
        write_made_from(tmp, f"sft {fingerprint}")
        shutil.rmtree(model_dir, ignore_errors=True)
        tmp.rename(model_dir)  # a half-written model never sits at model_dir
    distributed.wait_for_everyone()
    return model_dir


def save_for_inference(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """`save_pretrained` of a trained model and its tokenizer, with the KV cache on: training turns it off, and a
    run that resumed after its last step (so never trained) would save it on, giving other bytes for one model."""
    model.config.use_cache = True
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def lora_config(model: PreTrainedModel, lora: LoraSettings) -> Any:
    """The peft LoraConfig for `model` (shared by SFT, GRPO and PPO)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=_lora_targets(model, lora), task_type="CAUSAL_LM")


def _lora_targets(model: PreTrainedModel, lora: LoraSettings) -> str | list[str]:
    """LoRA's target modules; with `top_layers`, the full names of the matching linear layers in the top layers.

    (peft refuses `layers_to_transform` together with "all-linear", so the top-layer selection is done here: the
    first number in a module's name is its layer index in Hugging Face decoders, e.g. `model.layers.29.mlp.up_proj`.)
    """
    wanted = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    if lora.top_layers is None:
        return wanted
    import torch

    first = model.config.num_hidden_layers - lora.top_layers
    head = model.get_output_embeddings()
    names = []
    for name, module in model.named_modules():
        layer = re.search(r"\.(\d+)\.", name)
        if not isinstance(module, torch.nn.Linear) or module is head or layer is None or int(layer[1]) < first:
            continue
        if wanted == "all-linear" or name.rsplit(".", 1)[-1] in wanted:
            names.append(name)
    if not names:
        raise ValueError(f"LoRA: no linear layers match {wanted!r} in the top {lora.top_layers} layers")
    return names


def resolve_precision(precision: Literal["auto", "fp32", "bf16"]) -> Literal["fp32", "bf16"]:
    if precision != "auto":
        return precision
    import torch

    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    try:  # Linux CPU flags: bf16 matrix instructions, not merely AVX2 (where torch emulates bf16 matmuls)
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "bf16" if re.search(r"\b(amx_bf16|avx512_bf16)\b", flags) else "fp32"


def hardware() -> str:
    """The device that computes: the GPU's name, or the CPU's model (Linux) or architecture."""
    import torch

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name()}"
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        found = None
    return f"cpu: {found.group(1).strip() if found else platform.machine()}"


def _fingerprint(dataset: Dataset, base_model: str, settings: TrainingSettings, emphasis: Emphasis | None = None
                 ) -> str:
    recipe = [base_model, asdict(settings)] + ([asdict(emphasis)] if emphasis else [])  # no emphasis: as before it
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode())
    for row in dataset:
        digest.update(json.dumps(row, sort_keys=True).encode())
    return digest.hexdigest()


def _seconds_until(checkpoint: str | None) -> float:
    """The training time recorded in `checkpoint` (0 without one, or for a checkpoint older than SECONDS_FILE)."""
    path = Path(checkpoint) / SECONDS_FILE if checkpoint else None
    return float(path.read_text()) if path is not None and path.is_file() else 0.0


def _trained_on(checkpoint: str) -> tuple[str, str] | None:
    """The precision and hardware `checkpoint` was trained in (TRAINED_ON_FILE), or None for one older than it."""
    path = Path(checkpoint) / TRAINED_ON_FILE
    record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    return (record["precision"], record["hardware"]) if record else None


def _progress_log(earlier_seconds: float, precision: str) -> Any:
    """A TrainerCallback that logs step, loss, learning rate and ETA (the pace of this run, resumed steps excluded)
    and writes the training time so far, `earlier_seconds` included, and what it trains in and on (`precision`,
    `hardware()`) into every checkpoint it saves."""
    from transformers import TrainerCallback  # here, not at module level: importing transformers takes seconds

    machine = hardware()

    class ProgressLog(TrainerCallback):
        start = time.monotonic()

        def seconds(self) -> float:
            return earlier_seconds + time.monotonic() - self.start

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start, self.first_step = time.monotonic(), state.global_step

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            # the trainer saves the checkpoint (its main process), then calls on_save; unrounded, as resumes add
            if state.is_world_process_zero and checkpoint.is_dir():
                (checkpoint / SECONDS_FILE).write_text(f"{self.seconds()!r}\n", encoding="utf-8")
                (checkpoint / TRAINED_ON_FILE).write_text(json.dumps({"precision": precision, "hardware": machine})
                                                          + "\n", encoding="utf-8")

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if not logs or "loss" not in logs or not state.is_world_process_zero:
                return
            done = state.global_step - self.first_step
            elapsed = time.monotonic() - self.start
            eta = elapsed / done * (state.max_steps - state.global_step) if done else float("nan")
            log.info("step %d/%d loss %.4f lr %.2e | %.1fs/step, ETA %.0fs", state.global_step, state.max_steps,
                     logs["loss"], logs.get("learning_rate", float("nan")), elapsed / max(done, 1), eta)

    return ProgressLog()


def has_trained_model(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds what load_trained_model loads: a plain model or a LoRA adapter (e.g. an RL
    checkpoint, which can then be evaluated like a finished policy)."""
    return any((Path(model_dir) / name).is_file() for name in ("config.json", "adapter_config.json"))


def load_trained_model(
    model_dir: str | Path, dtype: Literal["float32", "bfloat16"] = "float32", device: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load what `train_sft` saved: a plain (merged or fully fine-tuned) model, or a LoRA adapter."""
    from components.llm.models import load_causal_lm

    model_dir = Path(model_dir)
    if not (model_dir / "adapter_config.json").is_file():
        return load_causal_lm(str(model_dir), cache_dir=model_dir.parent, dtype=dtype, device=device)
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = device or distributed.device()
    return model.to(device), tokenizer
