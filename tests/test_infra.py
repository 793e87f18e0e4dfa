"""Static checks of infra/: the Dockerfiles, the .dockerignore, the Cloud Build config (Terraform: test_terraform.py).

No Docker engine and no cloud here: the files are parsed (tests/dockerfiles.py) and checked for what they must do:
install the project from the repository root with dependencies in their own layer, run as a non-root user, build
and push the three images. What only a real build shows is listed in infra/README.md.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.dockerfiles import (
    Dockerfile, arg_default, copy_parts, env_of, final_user, parse_dockerfile, parse_instructions,
)

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
DOCKER = INFRA / "docker"
DOCKERFILES = {kind: DOCKER / f"Dockerfile.{kind}" for kind in ("cpu", "gpu", "tpu")}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

pytestmark = pytest.mark.timeout(120)


def project_packages() -> list[str]:
    """Top-level packages pyproject.toml ships (its `packages.find.include` patterns)."""
    patterns = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    names = [p.rstrip("*").rstrip(".") for p in patterns]
    assert all((ROOT / n / "__init__.py").is_file() for n in names), names
    return names


# ---------------------------------------------------------------------------------------------
# Dockerfiles


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def dockerfile(request) -> tuple[str, Dockerfile]:
    return request.param, parse_dockerfile(DOCKERFILES[request.param])


def test_the_old_single_dockerfile_is_gone():
    assert not (INFRA / "Dockerfile.cpu").exists(), "infra/docker/Dockerfile.cpu replaces infra/Dockerfile.cpu"


def test_instruction_reading_joins_continuations_and_drops_comments(tmp_path):
    text = "# c\nARG A=1\nFROM x AS y\nRUN a \\\n  # inside\n  && b\nENV K=v L=\"w z\"\nENV M legacy value\n"
    ins = parse_instructions(text)
    assert [i.cmd for i in ins] == ["ARG", "FROM", "RUN", "ENV", "ENV"]
    assert ins[2].args == "a && b" and ins[2].line == 4
    assert env_of(ins) == {"K": "v", "L": "w z", "M": "legacy value"}
    # an empty line inside a continuation (deprecated by Docker) reads as a bogus instruction: rejected
    (tmp_path / "Dockerfile").write_text("FROM x\nRUN a \\\n\n  && b\n")
    with pytest.raises(AssertionError, match="unknown instruction"):
        parse_dockerfile(tmp_path / "Dockerfile")


def test_dockerfile_runs_as_a_non_root_user(dockerfile):
    kind, df = dockerfile
    user = final_user(df.default)
    assert user is not None, f"{kind}: the default target sets no USER (would run as root)"
    assert user.split(":")[0] not in ("root", "0"), f"{kind}: USER {user}"
    # USER comes after every RUN, so that the installs run as root and the steps do not
    last_run = max(i for i, ins in enumerate(df.default.instructions()) if ins.cmd == "RUN")
    last_user = max(i for i, ins in enumerate(df.default.instructions()) if ins.cmd == "USER")
    assert last_user > last_run
    # the user exists, and KFP's artifact mount points are created for it
    run = " ".join(ins.args for ins in df.default.instructions() if ins.cmd == "RUN")
    assert re.search(rf"useradd\b.*\b{re.escape(user)}\b", run)
    for mount in ("/gcs", "/minio", "/s3"):
        assert mount in run, f"{kind}: {mount} is not created for the non-root user"
    assert re.search(rf"chown {re.escape(user)}:{re.escape(user)} /gcs /minio /s3", run)


def test_dockerfile_sets_tokenizers_parallelism(dockerfile):
    kind, df = dockerfile
    assert env_of(df.default.instructions()).get("TOKENIZERS_PARALLELISM") == "false"


def test_dockerfile_installs_dependencies_before_the_source(dockerfile):
    kind, df = dockerfile
    instructions = df.default.instructions()
    deps_run = next(i for i, ins in enumerate(instructions)
                    if ins.cmd == "RUN" and re.search(r"pip install -r \S*requirements\.txt", ins.args))
    # the requirements come from pyproject.toml through infra/docker/deps.py
    assert re.search(r"deps\.py \S*pyproject\.toml", instructions[deps_run].args)
    # ...and only pyproject.toml and deps.py are in the image when they are installed
    before = [src for ins in instructions[:deps_run] if ins.cmd in ("COPY", "ADD")
              for src in copy_parts(ins)[1] if "--from" not in " ".join(copy_parts(ins)[0])]
    assert sorted(set(before)) == ["infra/docker/deps.py", "pyproject.toml"], before
    first_source = min(i for i, ins in enumerate(instructions) if ins.cmd == "COPY"
                       and set(copy_parts(ins)[1]) & set(project_packages()))
    assert deps_run < first_source


def test_dockerfile_installs_the_project_from_the_repository_root(dockerfile):
    kind, df = dockerfile
    instructions = df.default.instructions()
    copies = [copy_parts(ins) for ins in instructions if ins.cmd == "COPY"]
    # every source is a path of the repository (the build context is its root)
    for flags, sources, dest in copies:
        if any(f.startswith("--from") for f in flags):
            continue
        for src in sources:
            assert (ROOT / src).exists(), f"{kind}: COPY {src}: no such path in the repository"
    # the directory that receives pyproject.toml receives README.md (its readme) and every package...
    src_dir = next(dest for _, sources, dest in copies if "pyproject.toml" in sources and "README.md" in sources)
    assert src_dir.endswith("/")
    copied = {src: dest for _, sources, dest in copies for src in sources}
    for package in project_packages():
        assert copied.get(package) == src_dir + package, f"{kind}: package {package} is not copied to {src_dir}"
    # ...and is what pip installs, without re-resolving the dependencies, then checks
    install = [ins.args for ins in instructions
               if ins.cmd == "RUN" and re.search(rf"pip install --no-deps {re.escape(src_dir.rstrip('/'))}/?(\s|$)", ins.args)]
    assert install, f"{kind}: no `pip install --no-deps {src_dir}`"
    assert "pip check" in install[0]
    assert "maxpipe --help" in install[0] and "cd /" in install[0]  # the installed copy, not the source dir


def test_gpu_image_installs_jax_with_a_cuda_extra_that_exists():
    df = parse_dockerfile(DOCKERFILES["gpu"])
    jax_cuda = arg_default(df.default, df, "JAX_CUDA")
    assert jax_cuda in ("cuda12", "cuda13")
    # the extra exists in the jax version the project installs (cuda12 and cuda13 both do in 0.10)
    assert jax_cuda in importlib.metadata.metadata("jax").get_all("Provides-Extra")
    run = " ".join(ins.args for ins in df.default.instructions() if ins.cmd == "RUN")
    assert '--jax-extra "${JAX_CUDA}"' in run
    assert 'pip show "jax-${JAX_CUDA}-plugin"' in run
    env = env_of(df.default.instructions())
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert "/usr/local/nvidia/lib64" in env["LD_LIBRARY_PATH"]


def test_tpu_image_installs_jax_with_libtpu():
    df = parse_dockerfile(DOCKERFILES["tpu"])
    run = " ".join(ins.args for ins in df.default.instructions() if ins.cmd == "RUN")
    assert "--jax-extra tpu" in run and "pip show libtpu" in run
    # jax's tpu extra is what brings libtpu, at the version matching jax
    tpu_reqs = [r for r in importlib.metadata.requires("jax") if 'extra == "tpu"' in r]
    assert any(r.startswith("libtpu") for r in tpu_reqs), tpu_reqs


def test_cpu_image_has_a_dataflow_worker_target():
    df = parse_dockerfile(DOCKERFILES["cpu"])
    assert df.default.name == "runtime"
    beam_sdk = df.stage("beam-sdk")
    assert beam_sdk.base == "apache/beam_python${PYTHON_VERSION}_sdk:${BEAM_VERSION}"
    dataflow = df.stage("dataflow")
    assert dataflow.parent is df.stage("base") and df.default.parent is df.stage("base")
    own = dataflow.own
    assert any(ins.cmd == "COPY" and ins.args == "--from=beam-sdk /opt/apache/beam /opt/apache/beam" for ins in own)
    assert [ins.args for ins in own if ins.cmd == "ENTRYPOINT"] == ['["/opt/apache/beam/boot"]']
    # the worker uses the packages installed in the image instead of making a fresh venv
    assert env_of(dataflow.instructions())["RUN_PYTHON_SDK_IN_DEFAULT_ENVIRONMENT"] == "1"
    # the one documented root image: Dataflow mounts root-owned worker directories
    assert final_user(dataflow) is None


def test_cpu_image_beam_and_python_versions_match_the_project():
    from packaging.specifiers import SpecifierSet

    df = parse_dockerfile(DOCKERFILES["cpu"])
    beam = df.global_args["BEAM_VERSION"]
    spec = next(r for r in PYPROJECT["project"]["dependencies"] if r.startswith("apache-beam"))
    assert beam in SpecifierSet(spec[len("apache-beam"):]), f"BEAM_VERSION {beam} vs pyproject {spec}"
    run = " ".join(ins.args for ins in df.default.instructions() if ins.cmd == "RUN")
    assert 'pip install --no-deps "apache-beam==${BEAM_VERSION}"' in run
    assert "--extra-of apache-beam:gcp --exclude google-cloud-aiplatform" in run
    for kind, path in DOCKERFILES.items():
        python = parse_dockerfile(path).global_args["PYTHON_VERSION"]
        assert python + ".0" in SpecifierSet(PYPROJECT["project"]["requires-python"]), kind
    # Cloud Build passes the same defaults
    subs = yaml.safe_load((INFRA / "cloudbuild.yaml").read_text())["substitutions"]
    assert subs["_BEAM_VERSION"] == beam
    assert subs["_PYTHON_VERSION"] == df.global_args["PYTHON_VERSION"]
    gpu = parse_dockerfile(DOCKERFILES["gpu"])
    assert subs["_JAX_CUDA"] == arg_default(gpu.default, gpu, "JAX_CUDA")


# ---------------------------------------------------------------------------------------------
# infra/docker/deps.py: the requirement list of the dependency layer


@pytest.fixture(scope="module")
def deps():
    spec = importlib.util.spec_from_file_location("maxpipe_infra_deps", DOCKER / "deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deps_lists_the_project_dependencies(deps):
    assert deps.requirements(str(ROOT / "pyproject.toml")) == PYPROJECT["project"]["dependencies"]


def test_deps_adds_the_jax_extra_keeping_the_bounds(deps):
    reqs = deps.requirements(str(ROOT / "pyproject.toml"), jax_extra="cuda12")
    original = next(r for r in PYPROJECT["project"]["dependencies"] if deps.canonical(deps.split(r)[0]) == "jax")
    assert f"jax[cuda12]{deps.split(original)[2]}" in reqs
    assert len(reqs) == len(PYPROJECT["project"]["dependencies"])
    assert deps.requirements(str(ROOT / "pyproject.toml"), jax_extra="tpu")[0].startswith("jax[tpu]")


def test_deps_pins_replace_the_requirement_of_the_same_name(deps):
    reqs = deps.requirements(str(ROOT / "pyproject.toml"), pins=["Apache_Beam==2.77.0"])
    assert "Apache_Beam==2.77.0" in reqs
    assert not [r for r in reqs if r.startswith("apache-beam")]
    with pytest.raises(SystemExit):
        deps.requirements(str(ROOT / "pyproject.toml"), pins=["not-a-dependency==1"])


def test_deps_takes_an_installed_distributions_extra_minus_exclusions(deps):
    reqs = deps.requirements(str(ROOT / "pyproject.toml"), extra_of=["apache-beam:gcp"],
                             exclude=["google-cloud-aiplatform"])
    extra = reqs[len(PYPROJECT["project"]["dependencies"]):]
    names = {deps.canonical(deps.split(r)[0]) for r in extra}
    assert {"google-cloud-storage", "google-apitools", "google-auth"} <= names  # DataflowRunner, GCS
    assert "google-cloud-aiplatform" not in names
    assert not any("extra" in r for r in extra)
    # the project's own google-cloud-aiplatform requirement stays
    assert any(r.startswith("google-cloud-aiplatform") for r in reqs[:len(PYPROJECT["project"]["dependencies"])])
    with pytest.raises(SystemExit):
        deps.extra_requirements("apache-beam", "no-such-extra")


def test_deps_command_line(tmp_path):
    out = subprocess.run([sys.executable, str(DOCKER / "deps.py"), str(ROOT / "pyproject.toml"), "--jax-extra", "cuda13"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("jax[cuda13]") and len(out) == len(PYPROJECT["project"]["dependencies"])


# ---------------------------------------------------------------------------------------------
# .dockerignore (kept at infra/docker/dockerignore, copied to the context root before a build)


def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """(is_exception, regex) per line, with Docker's syntax: `*` and `?` stop at `/`, `**`
    crosses directories, `!` re-includes, the last matching line wins."""
    patterns = []
    for line in (DOCKER / "dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line.lstrip("!").strip().strip("/")
        rx, i = "", 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pat.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pat[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pat[i] == "?":
                rx, i = rx + "[^/]", i + 1
            elif pat[i] == "[":
                j = pat.index("]", i)
                rx, i = rx + pat[i:j + 1], j + 1
            else:
                rx, i = rx + re.escape(pat[i]), i + 1
        patterns.append((negate, re.compile(rx + r"\Z")))
    return patterns


def ignored(path: str, patterns=None) -> bool:
    """Whether Docker leaves `path` (relative to the context root) out of the context: a pattern
    that matches the path or one of its parent directories applies to it."""
    patterns = patterns if patterns is not None else dockerignore_patterns()
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for negate, rx in patterns:
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_images_copy_and_drops_the_rest():
    patterns = dockerignore_patterns()
    for kind, path in DOCKERFILES.items():
        for ins in parse_dockerfile(path).default.instructions():
            if ins.cmd != "COPY" or "--from" in ins.args:
                continue
            for src in copy_parts(ins)[1]:
                files = [src] if (ROOT / src).is_file() else [
                    str(f.relative_to(ROOT)) for f in (ROOT / src).rglob("*.py") if "__pycache__" not in f.parts]
                assert files
                for f in files:
                    assert not ignored(f, patterns), f"{kind}: COPY {src}: {f} is dockerignored"
    for path in (".venv/bin/python", ".git/HEAD", "runs/x/manifest.json", "tests/test_infra.py",
                 "benchmarks/RESULTS.md", "configs/__pycache__/schema.cpython-311.pyc",
                 "trainer/model.pyc", "maxpipe.egg-info/PKG-INFO", "infra/terraform/main.tf"):
        assert ignored(path, patterns), path
    for path in ("configs/base.yml", "configs/models/demo.yml", "pipelines/cli.py", "infra/docker/deps.py"):
        assert not ignored(path, patterns), path


def test_the_image_source_layout_builds_a_complete_wheel(tmp_path):
    """Lay out the build context the way the Dockerfile's COPYs do (only files the dockerignore
    keeps) and build the wheel from it as `pip install --no-deps` would: a missing COPY (README.md
    is pyproject's readme, the YAML configs are package data) fails here rather than in Cloud Build."""
    pytest.importorskip("setuptools")
    patterns = dockerignore_patterns()
    df = parse_dockerfile(DOCKERFILES["cpu"])
    src_dir = None
    for ins in df.default.instructions():
        if ins.cmd != "COPY" or "--from" in ins.args:
            continue
        flags, sources, dest = copy_parts(ins)
        if "README.md" in sources:
            src_dir = dest
        if src_dir is None or not dest.startswith(src_dir):
            continue
        for src in sources:
            files = [ROOT / src] if (ROOT / src).is_file() else sorted(p for p in (ROOT / src).rglob("*") if p.is_file())
            for f in files:
                rel = str(f.relative_to(ROOT))
                if ignored(rel, patterns):
                    continue
                target = tmp_path / "ctx" / dest.lstrip("/") / (f.name if (ROOT / src).is_file() else f.relative_to(ROOT / src))
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, target)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "-w", str(tmp_path / "dist"), str(tmp_path / "ctx" / src_dir.strip("/"))],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("maxpipe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in project_packages():
        assert f"{package}/__init__.py" in names
    assert "configs/base.yml" in names
    assert {f"configs/models/{p.name}" for p in (ROOT / "configs" / "models").glob("*.yml")} <= names
    assert {f"configs/presets/{p.name}" for p in (ROOT / "configs" / "presets").glob("*.yml")} <= names
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]


# ---------------------------------------------------------------------------------------------
# Cloud Build

IMAGE_PREFIX = "${_REGION}-docker.pkg.dev/$PROJECT_ID/${_REPO}/"


@pytest.fixture(scope="module")
def cloudbuild() -> dict:
    return yaml.safe_load((INFRA / "cloudbuild.yaml").read_text())


def test_cloudbuild_pushes_the_three_images_with_both_tags(cloudbuild):
    images = cloudbuild["images"]
    for kind in ("cpu", "gpu", "tpu", "dataflow"):
        for tag in ("$SHORT_SHA", "latest"):
            assert f"{IMAGE_PREFIX}maxpipe-{kind}:{tag}" in images
    assert len(images) == len(set(images)) == 8


def test_cloudbuild_substitutions_have_defaults(cloudbuild):
    subs = cloudbuild["substitutions"]
    assert subs["_REGION"] and subs["_REPO"]
    text = (INFRA / "cloudbuild.yaml").read_text()
    used = set(re.findall(r"\$\{?(_[A-Z0-9_]+)", re.sub(r"(?m)#.*$", "", text)))
    assert used <= set(subs), f"substitutions used without a default: {used - set(subs)}"
    assert set(subs) <= used, f"unused substitutions (Cloud Build rejects them): {set(subs) - used}"
    for key, value in subs.items():
        assert isinstance(value, str), f"{key}: substitution values must be strings"


def test_cloudbuild_builds_every_pushed_tag_from_the_repository_root(cloudbuild):
    steps = {s["id"]: s for s in cloudbuild["steps"]}
    assert len(steps) == len(cloudbuild["steps"]), "step ids must be unique"
    order = [s["id"] for s in cloudbuild["steps"]]

    def waits_for(step_id: str) -> set[str]:
        """Every step that must finish first: waitFor, or all earlier steps when it is absent."""
        direct = steps[step_id].get("waitFor", order[:order.index(step_id)])
        direct = set() if direct == ["-"] else set(direct)
        return direct.union(*(waits_for(d) for d in direct))

    tagged, built = set(), set()
    for step in cloudbuild["steps"]:
        args = step.get("args", [])
        if step["name"] != "gcr.io/cloud-builders/docker" or not args or args[0] != "build":
            continue
        assert args[-1] == ".", f"{step['id']}: the context must be the repository root"
        dockerfile = next(a.split("=", 1)[1] for a in args if a.startswith("--file="))
        assert (ROOT / dockerfile).is_file()
        built.add(dockerfile)
        tags = [a.split("=", 1)[1] for a in args if a.startswith("--tag=")]
        assert tags and all(t.startswith(IMAGE_PREFIX) for t in tags)
        tagged.update(tags)
        # targets name real stages
        for a in args:
            if a.startswith("--target="):
                assert parse_dockerfile(ROOT / dockerfile).stage(a.split("=", 1)[1])
        for a in args:
            if a.startswith("--build-arg=") and not a.startswith("--build-arg=BUILDKIT_"):
                name = a.split("=", 2)[1]
                assert f"ARG {name}" in (ROOT / dockerfile).read_text(), f"{step['id']}: no ARG {name}"
        # builds wait for the .dockerignore to be in place
        assert "dockerignore" in waits_for(step["id"]), f"{step['id']} may start before .dockerignore is copied"
    assert tagged == set(cloudbuild["images"])
    assert built == {f"infra/docker/Dockerfile.{k}" for k in ("cpu", "gpu", "tpu")}
    assert steps["dockerignore"]["args"] == ["-c", "cp infra/docker/dockerignore .dockerignore"]
    # bash variables are escaped ($$) so that Cloud Build does not read them as substitutions
    script = steps["pull-cache"]["args"][-1]
    assert "$$image" in script and "$image" not in script.replace("$$image", "")
