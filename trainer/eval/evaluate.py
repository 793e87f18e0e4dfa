"""Evaluation: validation loss/perplexity over the val shards, a sampled continuation of a prompt, multiple-choice tasks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from configs import EvalConfig, ModelConfig, UserError
from trainer.train.data import shard_paths
from trainer.eval.decode import generate_batch
from trainer.train.loss import validation_loss
from trainer.eval.multiple_choice import score_task
from trainer.hf.tokenizer import load_tokenizer


def generate(
    params: Any,
    cfg: ModelConfig,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    eos_id: int | None,
    top_p: float = 1.0,
) -> list[int]:
    """New token ids after the prompt, up to max_new_tokens or EOS (not included); greedy when temperature is 0."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    return generate_batch(params, cfg, [prompt_ids], max_new_tokens, temperature, top_k, top_p, seed, eos_id)[0]


def evaluate(
    params: Any, model_cfg: ModelConfig, eval_cfg: EvalConfig, dataset_dir: str | Path, log: Callable[[str], Any] = print
) -> dict:
    """Validation loss over the dataset's val shards, a sampled continuation of eval_cfg.prompt, eval_cfg.tasks' scores."""
    tokenizer = load_tokenizer(Path(dataset_dir) / "tokenizer")
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise UserError(
            f"the dataset's tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {model_cfg.vocab_size}"
        )
    val = validation_loss(params, model_cfg, shard_paths(dataset_dir, "val"), eval_cfg.batch_size, eval_cfg.max_batches)
    log(
        f"val loss {val['loss']:.4f}, perplexity {val['perplexity']:.2f} "
        f"over {val['tokens']} tokens in {val['sequences']} sequences"
    )

    prompt_ids = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(eval_cfg.prompt)
    sample = ""
    if prompt_ids and eval_cfg.max_new_tokens:
        new_ids = generate(
            params, model_cfg, prompt_ids, eval_cfg.max_new_tokens, eval_cfg.temperature, eval_cfg.top_k,
            eval_cfg.seed, tokenizer.eos_id, eval_cfg.top_p,
        )
        sample = tokenizer.decode(new_ids)
    elif not prompt_ids:
        log("no sample: eval.prompt is empty and the tokenizer has no BOS token")
    log(f"sample: {eval_cfg.prompt!r} -> {sample!r}")
    tasks = []
    for path in eval_cfg.tasks:
        tasks.append(score_task(params, model_cfg, tokenizer, path, eval_cfg.batch_size))
        log(f"task {tasks[-1]['task']}: accuracy {tasks[-1]['accuracy']:.4f}, "
            f"normalised {tasks[-1]['accuracy_norm']:.4f} over {tasks[-1]['examples']} examples")
    return {
        "val_loss": val["loss"],
        "val_perplexity": val["perplexity"],
        "val_tokens": val["tokens"],
        "prompt": eval_cfg.prompt,
        "sample": sample,
        "tasks": tasks,
    }
