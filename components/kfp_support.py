"""What every KFP component does around its step: parse the config, place the output in the store, report errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from configs import Config, UserError
from components import steps
from contract.manifest import GCS_MOUNT

ERROR_PREFIX = "maxpipe error: "
TRAIN_METRICS = ("final_loss", "tokens_per_s", "mfu")  # the train step's KFP metrics besides the goodput totals


def kfp_step(
    plan: Callable[[Config], steps.Step], config_json: str, artifact: Any,
    run: Callable[[steps.Step, str], dict[str, Any]] = steps.execute,
) -> dict[str, Any]:
    """Run a planned step into the content-addressed store and point the KFP output artifact at it.

    The artifact's URI becomes `{store}/{step}/{version}`: a rerun that plans the same version finds
    the directory complete and skips the work, under kfp.local, Vertex AI or Kubeflow alike.
    `run(step, out_dir) -> manifest` does the work (here, or in a custom job the task waits for).
    """
    try:
        cfg = Config.model_validate_json(config_json)
        step = plan(cfg)
        artifact.path = str(steps.store_dir(store_root(cfg), step))  # also sets artifact.uri (gs:// for /gcs/)
        manifest = run(step, artifact.path)
    except UserError as err:
        # One line the launcher picks out of the component's log and shows the user.
        print(f"{ERROR_PREFIX}{err}", flush=True)
        sys.exit(1)
    artifact.metadata.update(artifact_metadata(manifest))
    return manifest


def store_root(cfg: Config) -> str:
    """The store directory as this process sees it: `pipeline.store`, else `{pipeline.root}/store`."""
    store = cfg.pipeline.store or f"{cfg.pipeline.root.rstrip('/')}/store"
    return GCS_MOUNT + store.removeprefix("gs://") if store.startswith("gs://") else str(Path(store).absolute())


def train_init(cfg: Config, dataset_dir: str, init_dir: str | None) -> str | None:
    """Where training starts: the ingested params, or with `continue_from` the latest export in the store."""
    if cfg.train.continue_from == "latest_export":
        latest = steps.latest_export(store_root(cfg), cfg, dataset_dir)
        return str(latest) if latest else init_dir
    return init_dir


def artifact_metadata(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's identity, versioned config and scalar stats, as KFP/Vertex artifact metadata."""
    scalars = {k: v for k, v in manifest["stats"].items() if isinstance(v, (int, float, str, bool))}
    return {**scalars, "version": manifest["version"], "kind": manifest["kind"], "step": manifest["step"],
            "code_version": manifest["code_version"], "config": manifest["config"]}


def train_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """The train step's KFP metrics from its manifest's stats: final loss, throughput, MFU and the goodput totals."""
    return {k: v for k, v in stats.items() if (k in TRAIN_METRICS or k.startswith("goodput"))
            and isinstance(v, (int, float)) and not isinstance(v, bool)}
