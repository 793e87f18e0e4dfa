"""What every KFP component does around its step: parse the config, stamp the artifact, report errors."""

from __future__ import annotations

import sys
from typing import Any, Callable

from configs import Config, UserError

ERROR_PREFIX = "maxpipe error: "


def kfp_step(run: Callable[[Config], dict[str, Any]], config_json: str, artifact: Any) -> dict[str, Any]:
    """Run a step inside a KFP component and copy its manifest's identity and stats onto the output artifact."""
    try:
        manifest = run(Config.model_validate_json(config_json))
    except UserError as err:
        # One line the launcher picks out of the component's log and shows the user.
        print(f"{ERROR_PREFIX}{err}", flush=True)
        sys.exit(1)
    artifact.metadata.update(artifact_metadata(manifest))
    return manifest


def artifact_metadata(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's identity and its scalar stats, as KFP/Vertex artifact metadata."""
    scalars = {k: v for k, v in manifest["stats"].items() if isinstance(v, (int, float, str, bool))}
    return {"version": manifest["version"], "kind": manifest["kind"], "step": manifest["step"],
            "code_version": manifest["code_version"], **scalars}
