#!/usr/bin/env python3
"""Print maxpipe's runtime requirements from pyproject.toml, one per line.

The images install dependencies in a layer of their own, before the source is copied, so that
editing the code does not reinstall gigabytes of wheels: only pyproject.toml (and this script)
are in the build context of that layer. Standard library only (tomllib: Python 3.11+).

    python deps.py pyproject.toml                                 # the [project] dependencies
    python deps.py pyproject.toml --jax-extra cuda12              # jax -> jax[cuda12] (same bounds)
    python deps.py pyproject.toml --pin 'apache-beam==2.77.0'     # replace one requirement
    python deps.py pyproject.toml --extra-of apache-beam:gcp --exclude google-cloud-aiplatform
        # also the requirements of an *installed* distribution's extra, minus some of them

Why --extra-of: apache-beam[gcp] (what DataflowRunner and Beam's GCS filesystem need) pins
google-cloud-aiplatform<2 for Beam's Vertex AI inference transforms, which maxpipe does not use,
while maxpipe needs google-cloud-aiplatform>=2.7: `pip install apache-beam[gcp]` cannot resolve
beside maxpipe. The CPU image installs apache-beam alone first (--no-deps), then resolves
maxpipe's dependencies together with Beam's gcp extra minus that one pin, in a single pip run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import tomllib

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?\s*(.*)$")


def canonical(name: str) -> str:
    """PEP 503 name normalisation: 'Apache_Beam' and 'apache-beam' are the same project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split(requirement: str) -> tuple[str, list[str], str]:
    """('name', [extras], 'rest': version specifiers and/or '; marker')."""
    m = _REQ.match(requirement)
    if not m:
        raise ValueError(f"cannot parse requirement {requirement!r}")
    name, extras, rest = m.groups()
    return name, [e.strip() for e in (extras or "").split(",") if e.strip()], rest.strip()


def join(name: str, extras: list[str], rest: str) -> str:
    return name + (f"[{','.join(extras)}]" if extras else "") + rest


def extra_requirements(dist: str, extra: str, exclude: list[str] = ()) -> list[str]:
    """The requirements an installed distribution declares for one of its extras, with the
    `extra == "..."` clause taken out of each marker (other conditions such as python_version
    stay, for pip to evaluate), leaving out the projects named in `exclude`."""
    clause = rf"""extra\s*==\s*["']{re.escape(extra)}["']"""
    excluded = {canonical(name) for name in exclude}
    try:
        declared = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"deps.py: {dist} is not installed (install it with --no-deps first)") from None
    found = []
    for req in declared:
        body, _, marker = req.partition(";")
        if not re.search(clause, marker):
            continue
        if " or " in marker.replace(")", " ").replace("(", " "):
            raise SystemExit(f"deps.py: cannot take the extra out of the marker of {req!r}")
        if canonical(split(body)[0]) in excluded:
            continue
        rest = re.sub(rf"\s*\band\s+{clause}|{clause}\s+and\b\s*|{clause}", "", marker).strip()
        found.append(body.strip() + (f"; {rest}" if rest else ""))
    if not found:
        raise SystemExit(f"deps.py: {dist} declares no extra {extra!r}")
    return found


def requirements(pyproject: str, extras: list[str] = (), jax_extra: str | None = None,
                 pins: list[str] = (), extra_of: list[str] = (), exclude: list[str] = ()) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"deps.py: no optional dependency group {extra!r} in {pyproject}")
        reqs += optional[extra]

    if jax_extra:
        for i, req in enumerate(reqs):
            name, have, rest = split(req)
            if canonical(name) == "jax":
                reqs[i] = join(name, sorted(set(have) | {jax_extra}), rest)
                break
        else:
            raise SystemExit(f"deps.py: --jax-extra given but {pyproject} does not depend on jax")

    for pin in pins:
        pin_name = canonical(split(pin)[0])
        hits = [i for i, req in enumerate(reqs) if canonical(split(req)[0]) == pin_name]
        if not hits:
            raise SystemExit(f"deps.py: --pin {pin!r} names no dependency of {pyproject}")
        for i in reversed(hits):
            del reqs[i]
        reqs.insert(hits[0], pin)

    for spec in extra_of:
        dist, sep, extra = spec.partition(":")
        if not sep or not dist or not extra:
            raise SystemExit(f"deps.py: --extra-of wants DIST:EXTRA, got {spec!r}")
        reqs += extra_requirements(dist, extra, exclude)
    return reqs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("--extra", action="append", default=[], help="also list an optional-dependencies group")
    parser.add_argument("--jax-extra", default=None, help="add this extra to the jax requirement (cuda12, cuda13, tpu)")
    parser.add_argument("--pin", action="append", default=[], help="replace the requirement of the same name with this one")
    parser.add_argument("--extra-of", action="append", default=[], metavar="DIST:EXTRA",
                        help="also list what the installed distribution DIST requires for its extra EXTRA")
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME",
                        help="leave this project out of the --extra-of requirements")
    args = parser.parse_args(argv)
    if args.exclude and not args.extra_of:
        parser.error("--exclude applies to --extra-of requirements only")
    print("\n".join(requirements(args.pyproject, args.extra, args.jax_extra, args.pin,
                                  args.extra_of, args.exclude)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
