"""One host of a multi-host training job (a Vertex AI custom job's worker pools run this on every host).

    python -m components.train_worker --config JSON --dataset DIR --out DIR [--init DIR]

Every process joins the JAX cluster (trainer/train/distributed.py reads CLUSTER_SPEC and the other
conventions), trains its share, and process 0 publishes the manifest once all of them are done.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from configs import Config, UserError
from components import steps
from components.kfp_support import ERROR_PREFIX


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m components.train_worker", description=__doc__)
    parser.add_argument("--config", required=True, help="the resolved config, as JSON")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--init", default=None)
    parser.add_argument("--version", default=None, help="the version the launcher planned: refuse to train another")
    args = parser.parse_args(argv)
    try:
        from trainer.train import distributed, xla_flags

        xla_flags.apply()  # before jax.process_index() below starts the backend (plan_train logs the flags)
        distributed.initialize()
        import jax

        index, count = jax.process_index(), jax.process_count()
        prefix = f"[process {index}/{count}] " if count > 1 else ""
        cfg = Config.model_validate_json(args.config)

        def log(line: str) -> None:
            print(prefix + line, flush=True)

        step = steps.plan_train(cfg, args.dataset, args.init, log)
        if args.version and step.version != args.version:
            # Another maxpipe (code version) in the train image than in the launcher's image.
            raise UserError(f"this host plans version {step.version} of the train step but the pipeline planned "
                            f"{args.version}: build the train image from the same maxpipe as the pipeline's")
        steps.execute(step, args.out, log, primary=index == 0, leased=False)  # the launcher holds the lease
    except UserError as err:
        print(f"{ERROR_PREFIX}{err}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
