"""Static checks of infra/: the Dockerfiles, the .dockerignore, the Cloud Build config, Terraform.

No Docker engine, no cloud and no terraform binary here: the files are parsed (small parsers
below) and checked for what they must do: install the project from the repository root with
dependencies in their own layer, run as a non-root user, build and push the three images, and
set up a project with least-privilege grants. What only a real build or `terraform apply` shows
is listed in infra/README.md.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
DOCKER = INFRA / "docker"
TERRAFORM = INFRA / "terraform"
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
# Dockerfile parsing

DOCKER_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
    "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}


@dataclass
class Instruction:
    cmd: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    parent: "Stage | None"
    own: list[Instruction] = field(default_factory=list)

    def instructions(self) -> list[Instruction]:
        """This stage's instructions after those of the stage it is built FROM, if any."""
        return (self.parent.instructions() if self.parent else []) + self.own


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    @property
    def default(self) -> Stage:
        """What `docker build` without --target produces: the last stage."""
        return self.stages[-1]


def parse_instructions(text: str) -> list[Instruction]:
    """Docker's line grammar: `#` comments, backslash continuations (comment and empty lines
    inside a continuation are dropped), one instruction per logical line."""
    out, buf, start = [], "", None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#") or (not line and buf == ""):
            continue
        if not line:  # empty line inside a continuation
            continue
        start = start or n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, args = buf.partition(" ")
        out.append(Instruction(cmd.upper(), " ".join(args.split()), start))
        buf, start = "", None
    assert buf == "", f"the file ends inside a continuation: {buf!r}"
    return out


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args, stages = {}, []
    for ins in parse_instructions(path.read_text()):
        assert ins.cmd in DOCKER_INSTRUCTIONS, f"{path.name}:{ins.line}: unknown instruction {ins.cmd}"
        if ins.cmd == "FROM":
            words = ins.args.split()
            words = [w for w in words if not w.startswith("--platform")]
            base = words[0]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"{path.name}:{ins.line}: FROM {ins.args}"
            parent = next((s for s in stages if s.name == base), None)
            stages.append(Stage(base, name, parent))
        elif not stages:
            assert ins.cmd == "ARG", f"{path.name}:{ins.line}: only ARG may come before the first FROM"
            key, _, value = ins.args.partition("=")
            global_args[key] = value
        else:
            stages[-1].own.append(ins)
    assert stages, f"{path.name}: no FROM"
    return Dockerfile(global_args, stages)


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    env = {}
    for ins in instructions:
        if ins.cmd != "ENV":
            continue
        words = shlex.split(ins.args)
        if "=" in words[0]:
            env.update(w.split("=", 1) for w in words)
        else:  # legacy `ENV KEY value with spaces`
            env[words[0]] = " ".join(words[1:])
    return env


def arg_default(stage: Stage, df: Dockerfile, name: str) -> str:
    for ins in stage.instructions():
        if ins.cmd == "ARG" and ins.args.partition("=")[0] == name and "=" in ins.args:
            return ins.args.partition("=")[2]
    return df.global_args[name]


def copy_parts(ins: Instruction) -> tuple[list[str], list[str], str]:
    """(flags, sources, destination) of a COPY."""
    words = ins.args.split()
    flags = [w for w in words if w.startswith("--")]
    rest = [w for w in words if not w.startswith("--")]
    return flags, rest[:-1], rest[-1]


def final_user(stage: Stage) -> str | None:
    users = [ins.args for ins in stage.instructions() if ins.cmd == "USER"]
    return users[-1] if users else None


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def dockerfile(request) -> tuple[str, Dockerfile]:
    return request.param, parse_dockerfile(DOCKERFILES[request.param])


def test_the_old_single_dockerfile_is_gone():
    assert not (INFRA / "Dockerfile.cpu").exists(), "infra/docker/Dockerfile.cpu replaces infra/Dockerfile.cpu"


def test_instruction_parser_handles_continuations_and_comments():
    text = "# c\nARG A=1\nFROM x AS y\nRUN a \\\n  # inside\n\n  && b\nENV K=v L=\"w z\"\n"
    ins = parse_instructions(text)
    assert [i.cmd for i in ins] == ["ARG", "FROM", "RUN", "ENV"]
    assert ins[2].args == "a && b" and ins[2].line == 4
    assert env_of(ins) == {"K": "v", "L": "w z"}


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


# ---------------------------------------------------------------------------------------------
# Terraform: a small HCL reader (blocks, attributes as source text, string/list literals)


@dataclass
class Token:
    kind: str  # "str", "heredoc", "punct", "word", "nl"
    text: str
    start: int
    end: int


def hcl_tokens(text: str) -> list[Token]:
    """Tokens of an HCL file, with strings (and their ${...} interpolations, which may hold
    strings and braces), heredocs and comments consumed whole; brackets are checked to balance."""
    tokens, i, stack = [], 0, []
    pairs = {"}": "{", "]": "[", ")": "("}
    line = lambda pos: text.count("\n", 0, pos) + 1  # noqa: E731
    while i < len(text):
        c = text[i]
        if c == "\n":
            tokens.append(Token("nl", c, i, i + 1))
            i += 1
        elif c in " \t\r":
            i += 1
        elif c == "#" or text.startswith("//", i):
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            assert j >= 0, f"line {line(i)}: unterminated /* comment"
            i = j + 2
        elif text.startswith("<<", i) and re.match(r"<<-?([A-Za-z_]\w*)\n", text[i:]):
            m = re.match(r"<<-?([A-Za-z_]\w*)\n", text[i:])
            end = re.compile(rf"(?m)^\s*{m.group(1)}\s*$").search(text, i + m.end())
            assert end, f"line {line(i)}: unterminated heredoc {m.group(1)}"
            tokens.append(Token("heredoc", text[i:end.end()], i, end.end()))
            i = end.end()
        elif c == '"':
            j, depth = i + 1, 0
            while True:
                assert j < len(text), f"line {line(i)}: unterminated string"
                if text[j] == "\\":
                    j += 2
                    continue
                if text.startswith("${", j) or text.startswith("%{", j):
                    depth, j = depth + 1, j + 2
                    continue
                if depth and text[j] == "{":
                    depth += 1
                elif depth and text[j] == "}":
                    depth -= 1
                elif depth and text[j] == '"':  # a string inside an interpolation
                    k = j + 1
                    while text[k] != '"':
                        k += 2 if text[k] == "\\" else 1
                    j = k
                elif not depth and text[j] == '"':
                    break
                elif not depth and text[j] == "\n":
                    raise AssertionError(f"line {line(i)}: newline in a string")
                j += 1
            tokens.append(Token("str", text[i:j + 1], i, j + 1))
            i = j + 1
        elif c in "{[(":
            stack.append((c, i))
            tokens.append(Token("punct", c, i, i + 1))
            i += 1
        elif c in "}])":
            assert stack and stack[-1][0] == pairs[c], f"line {line(i)}: unbalanced {c!r}"
            stack.pop()
            tokens.append(Token("punct", c, i, i + 1))
            i += 1
        elif c in "=,:?!<>+-*/%&|.":
            tokens.append(Token("punct", c, i, i + 1))
            i += 1
        else:
            m = re.compile(r"[A-Za-z0-9_\-.]+").match(text, i)
            assert m, f"line {line(i)}: unexpected {c!r}"
            tokens.append(Token("word", m.group(), i, m.end()))
            i = m.end()
    assert not stack, f"line {line(stack[-1][1])}: {stack[-1][0]!r} is never closed"
    return tokens


@dataclass
class Block:
    type: str
    labels: list[str]
    attrs: dict[str, str] = field(default_factory=dict)  # name -> expression source text
    blocks: list["Block"] = field(default_factory=list)

    def children(self, type_: str) -> list["Block"]:
        return [b for b in self.blocks if b.type == type_]


def parse_hcl(text: str) -> list[Block]:
    tokens = [t for t in hcl_tokens(text)]
    pos = 0

    def skip_nl():
        nonlocal pos
        while pos < len(tokens) and tokens[pos].kind == "nl":
            pos += 1

    def body(closing: bool) -> tuple[dict, list]:
        nonlocal pos
        attrs, blocks = {}, []
        while True:
            skip_nl()
            if pos >= len(tokens):
                assert not closing, "a block is never closed"
                return attrs, blocks
            if tokens[pos].text == "}" and closing:
                pos += 1
                return attrs, blocks
            name = tokens[pos]
            assert name.kind == "word", f"expected a name, got {name.text!r}"
            pos += 1
            if tokens[pos].text == "=":
                pos += 1
                first, depth = pos, 0
                while pos < len(tokens):
                    t = tokens[pos]
                    if t.kind == "punct" and t.text in "{[(":
                        depth += 1
                    elif t.kind == "punct" and t.text in "}])":
                        if depth == 0:
                            break
                        depth -= 1
                    elif t.kind == "nl" and depth == 0:
                        break
                    pos += 1
                assert pos > first, f"{name.text}: empty expression"
                assert name.text not in attrs, f"attribute {name.text} set twice"
                attrs[name.text] = text[tokens[first].start:tokens[pos - 1].end]
            else:
                labels = []
                while tokens[pos].text != "{":
                    assert tokens[pos].kind in ("str", "word"), f"{name.text}: bad label {tokens[pos].text!r}"
                    labels.append(tokens[pos].text.strip('"'))
                    pos += 1
                pos += 1
                a, b = body(closing=True)
                blocks.append(Block(name.text, labels, a, b))

    attrs, blocks = body(closing=False)
    assert not attrs, f"top-level attributes are not valid HCL configuration: {list(attrs)}"
    return blocks


def literal(expr: str):
    """The value of a literal expression: a string without interpolation, a number, a bool, or
    a list of those (comments and newlines allowed); anything else -> None."""
    toks = [t for t in hcl_tokens(expr) if t.kind != "nl"]

    def single(t: Token):
        if t.kind == "str" and "${" not in t.text and "%{" not in t.text:
            return re.sub(r'\\(.)', r"\1", t.text[1:-1])
        if t.kind == "word" and t.text in ("true", "false"):
            return t.text == "true"
        if t.kind == "word" and re.fullmatch(r"\d+(\.\d+)?", t.text):
            return float(t.text) if "." in t.text else int(t.text)
        return None

    if len(toks) == 1:
        return single(toks[0])
    if len(toks) >= 2 and toks[0].text == "[" and toks[-1].text == "]":
        inner = toks[1:-1]
        items, commas = inner[0::2], inner[1::2]  # item (, item)* ,?
        if any(c.text != "," for c in commas) or any(t.text == "," for t in items):
            return None
        values = [single(t) for t in items]
        return None if any(v is None for v in values) else values
    return None


@pytest.fixture(scope="module")
def tf() -> dict:
    files = {p.name: p.read_text() for p in sorted(TERRAFORM.glob("*.tf"))}
    assert set(files) >= {"main.tf", "variables.tf", "outputs.tf", "versions.tf"}
    blocks = [b for text in files.values() for b in parse_hcl(text)]
    locals_ = {}
    for b in blocks:
        if b.type == "locals":
            locals_.update(b.attrs)
    return {
        "files": files,
        "blocks": blocks,
        "resources": {(b.labels[0], b.labels[1]): b for b in blocks if b.type == "resource"},
        "variables": {b.labels[0]: b for b in blocks if b.type == "variable"},
        "outputs": {b.labels[0]: b for b in blocks if b.type == "output"},
        "locals": locals_,
    }


def resolve(tf: dict, expr: str):
    """A literal, or `var.X` (its default), `local.X`, `toset(...)` of those."""
    expr = expr.strip()
    m = re.fullmatch(r"toset\((.*)\)", expr, re.S)
    if m:
        return resolve(tf, m.group(1))
    m = re.fullmatch(r"local\.(\w+)", expr)
    if m:
        return resolve(tf, tf["locals"][m.group(1)])
    m = re.fullmatch(r"var\.(\w+)", expr)
    if m:
        return resolve(tf, tf["variables"][m.group(1)].attrs["default"])
    return literal(expr)


def grants(tf: dict, resource_type: str) -> list[tuple[str, str, Block]]:
    """(role, member expression, resource) for each grant a resource of this type makes; a
    `for_each` over a list expands `each.value` in role or member."""
    out = []
    for (rtype, _), res in tf["resources"].items():
        if rtype != resource_type:
            continue
        each = resolve(tf, res.attrs["for_each"]) if "for_each" in res.attrs else None
        assert "for_each" not in res.attrs or isinstance(each, list), f"{rtype}: cannot read for_each"
        role, member = res.attrs["role"].strip(), res.attrs["member"].strip()
        if each is None:
            assert literal(role) is not None, f"{rtype}: role {role} is not a literal"
            out.append((literal(role), member, res))
        elif role == "each.value":
            out += [(r, member, res) for r in each]
        else:
            out += [(literal(role), m, res) for m in (each if member == "each.value" else [member])]
    return out


SA_MEMBER = "local.sa_member"


def test_terraform_files_parse_and_reference_only_what_they_declare(tf):
    text = "\n".join(re.sub(r"(?m)(#|//).*$", "", t) for t in tf["files"].values())
    for name in set(re.findall(r"\bvar\.(\w+)", text)):
        assert name in tf["variables"], f"var.{name} is not declared"
    for name in set(re.findall(r"\blocal\.(\w+)", text)):
        assert name in tf["locals"], f"local.{name} is not defined"
    for rtype, name in set(re.findall(r"(?<![\w./-])(google_[a-z0-9_]+)\.([a-z_][a-z0-9_-]*)", text)):
        assert (rtype, name) in tf["resources"], f"{rtype}.{name} is not declared"
    for b in tf["blocks"]:
        assert b.type in ("terraform", "provider", "variable", "locals", "resource", "data", "output", "module")
    for (rtype, name), res in tf["resources"].items():
        assert rtype.startswith("google_"), rtype


def test_terraform_parses_with_python_hcl2_when_installed(tf):
    hcl2 = pytest.importorskip("hcl2")
    for name, text in tf["files"].items():
        hcl2.loads(text)


def test_hcl_reader_rejects_unbalanced_input():
    with pytest.raises(AssertionError):
        hcl_tokens('resource "a" "b" {\n  x = [1, 2\n}\n')
    with pytest.raises(AssertionError):
        hcl_tokens('x = "unterminated\n')
    blocks = parse_hcl('locals {\n  a = "${var.x}-{y}"  # c\n  b = ["p", "q"]\n  c = <<EOT\n}{\nEOT\n}\n')
    assert literal(blocks[0].attrs["b"]) == ["p", "q"] and literal(blocks[0].attrs["a"]) is None


def test_terraform_versions_and_variables(tf):
    (terraform,) = [b for b in tf["blocks"] if b.type == "terraform"]
    (providers,) = terraform.children("required_providers")
    assert re.search(r'source\s*=\s*"hashicorp/google"', providers.attrs["google"])
    assert "required_version" in terraform.attrs
    for name in ("project", "region", "bucket_name", "repo_name"):
        assert name in tf["variables"], name
    assert "default" not in tf["variables"]["project"].attrs  # no guessing the project


def test_terraform_enables_the_required_apis(tf):
    res = tf["resources"][("google_project_service", "apis")]
    services = set(resolve(tf, res.attrs["for_each"]))
    for api in ("aiplatform", "artifactregistry", "cloudbuild", "storage", "dataflow", "compute", "iam"):
        assert f"{api}.googleapis.com" in services, api
    assert literal(res.attrs["disable_on_destroy"]) is False


def test_terraform_pipeline_root_bucket(tf):
    (bucket,) = [r for (t, _), r in tf["resources"].items() if t == "google_storage_bucket"]
    assert literal(bucket.attrs["uniform_bucket_level_access"]) is True
    assert literal(bucket.attrs["public_access_prevention"]) == "enforced"
    assert bucket.attrs["location"].strip() == "var.region"
    assert bucket.children("versioning")
    rules = bucket.children("lifecycle_rule")
    temp = [r for r in rules if "matches_prefix" in r.children("condition")[0].attrs]
    assert temp, "no lifecycle rule for temporary files"
    prefixes = resolve(tf, temp[0].children("condition")[0].attrs["matches_prefix"])
    assert "tmp/" in prefixes
    assert literal(temp[0].children("action")[0].attrs["type"]) == "Delete"
    assert "age" in temp[0].children("condition")[0].attrs
    # the Dataflow temp location the outputs and README give is under that prefix
    assert "/tmp" in tf["outputs"]["dataflow_temp_location"].attrs["value"]


def test_terraform_docker_repository_and_service_account(tf):
    repo = tf["resources"][("google_artifact_registry_repository", "images")]
    assert literal(repo.attrs["format"]) == "DOCKER"
    assert repo.attrs["repository_id"].strip() == "var.repo_name"
    assert repo.attrs["location"].strip() == "var.region"
    sa = tf["resources"][("google_service_account", "pipelines")]
    assert sa.attrs["account_id"].strip() == "var.service_account_id"
    assert tf["locals"]["sa_member"].strip() == '"serviceAccount:${google_service_account.pipelines.email}"'


def test_terraform_service_account_has_exactly_the_least_privilege_grants(tf):
    project = {role for role, member, _ in grants(tf, "google_project_iam_member") if member == SA_MEMBER}
    assert project == {"roles/aiplatform.user", "roles/dataflow.developer", "roles/dataflow.worker",
                       "roles/logging.logWriter"}
    bucket = [(role, res) for role, member, res in grants(tf, "google_storage_bucket_iam_member") if member == SA_MEMBER]
    assert {role for role, _ in bucket} == {"roles/storage.objectAdmin", "roles/storage.legacyBucketReader"}
    for _, res in bucket:
        assert res.attrs["bucket"].strip() == "google_storage_bucket.pipeline_root.name"
    repo = [(role, res) for role, member, res in grants(tf, "google_artifact_registry_repository_iam_member")
            if member == SA_MEMBER]
    assert [role for role, _ in repo] == ["roles/artifactregistry.reader"]
    assert "google_artifact_registry_repository.images" in repo[0][1].attrs["repository"]
    act_as = [(role, res) for role, member, res in grants(tf, "google_service_account_iam_member") if member == SA_MEMBER]
    assert [role for role, _ in act_as] == ["roles/iam.serviceAccountUser"]
    assert act_as[0][1].attrs["service_account_id"].strip() == "google_service_account.pipelines.name"


def test_terraform_makes_no_broad_or_authoritative_grant(tf):
    project_roles = {role for role, _, _ in grants(tf, "google_project_iam_member")}
    forbidden = {"roles/owner", "roles/editor", "roles/storage.admin", "roles/storage.objectAdmin",
                 "roles/storage.objectUser", "roles/storage.objectCreator", "roles/iam.serviceAccountUser",
                 "roles/iam.serviceAccountTokenCreator", "roles/artifactregistry.writer",
                 "roles/artifactregistry.admin", "roles/resourcemanager.projectIamAdmin"}
    assert not project_roles & forbidden, project_roles & forbidden
    code = "\n".join(re.sub(r"(?m)(#|//).*$", "", t) for t in tf["files"].values())
    for role in ("roles/owner", "roles/editor", "roles/storage.admin"):
        assert f'"{role}"' not in code
    # authoritative resources would remove grants made outside this configuration
    for rtype, _ in tf["resources"]:
        assert not re.fullmatch(r"google_\w+_iam_(binding|policy)", rtype), rtype
    # every IAM resource type used is one of the scoped ones checked above
    iam_types = {rtype for rtype, _ in tf["resources"] if "_iam_" in rtype}
    assert iam_types <= {"google_project_iam_member", "google_storage_bucket_iam_member",
                         "google_artifact_registry_repository_iam_member", "google_service_account_iam_member"}


def test_terraform_outputs(tf):
    outputs = tf["outputs"]
    assert "google_storage_bucket.pipeline_root.name" in outputs["bucket"].attrs["value"]
    assert outputs["service_account_email"].attrs["value"].strip() == "google_service_account.pipelines.email"
    prefix = outputs["image_prefix"].attrs["value"]
    assert "-docker.pkg.dev/${var.project}/" in prefix and "google_artifact_registry_repository.images" in prefix
    assert outputs["pipeline_root"].attrs["value"].strip().startswith('"gs://${google_storage_bucket.pipeline_root.name}/')


# ---------------------------------------------------------------------------------------------
# infra/README.md: the walk-through names what exists


def test_readme_walkthrough_matches_the_files():
    readme = (INFRA / "README.md").read_text()
    outputs = {b.labels[0] for p in TERRAFORM.glob("*.tf") for b in parse_hcl(p.read_text()) if b.type == "output"}
    for name in re.findall(r"terraform output -raw (\w+)", readme):
        assert name in outputs, f"README uses terraform output {name}, which outputs.tf does not define"
    for path in re.findall(r"\b(infra/[\w./-]+\.(?:yaml|tf|py|md)\b|infra/docker/Dockerfile\.\w+)", readme):
        assert (ROOT / path).exists(), path
    for needle in ("gcloud builds submit --config infra/cloudbuild.yaml", "terraform init", "terraform apply",
                   "maxpipe compile", "maxpipe submit", "--pipeline-root", "--service-account",
                   "maxpipe schedule create", '--cron "TZ=Europe/Paris 0 3 * * 1"', "maxpipe lineage show",
                   "--target kfp --host", "--runner=DataflowRunner", "--sdk_container_image=",
                   "--temp_location=gs://"):
        assert needle in readme, needle
    for kind in ("cpu", "dataflow", "gpu", "tpu"):
        assert f"maxpipe-{kind}" in readme
