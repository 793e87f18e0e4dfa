"""The Dockerfiles as dockerfile-parse reads them: stages (with what they inherit), instructions, ENV, ARG, COPY."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

from dockerfile_parse import DockerfileParser
from dockerfile_parse.util import extract_key_values

DOCKER_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
    "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}


@dataclass
class Instruction:
    cmd: str
    args: str  # whitespace collapsed, continuations joined
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
    """The instructions of a Dockerfile (comments dropped, continuations joined), by dockerfile-parse."""
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=False)
    return [Instruction(item["instruction"].upper(), " ".join(item["value"].split()), item["startline"] + 1)
            for item in parser.structure if item["instruction"] != "COMMENT"]


def parse_dockerfile(path: Path) -> Dockerfile:
    """The file's global ARGs and stages; an unknown instruction (as a blank line in a continuation reads) fails."""
    global_args, stages = {}, []
    for ins in parse_instructions(path.read_text()):
        assert ins.cmd in DOCKER_INSTRUCTIONS, f"{path.name}:{ins.line}: unknown instruction {ins.cmd}"
        if ins.cmd == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--platform")]
            assert len(words) in (1, 3), f"{path.name}:{ins.line}: FROM {ins.args}"
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name, next((s for s in stages if s.name == words[0]), None)))
        elif not stages:
            assert ins.cmd == "ARG", f"{path.name}:{ins.line}: only ARG may come before the first FROM"
            key, _, value = ins.args.partition("=")
            global_args[key] = value
        else:
            stages[-1].own.append(ins)
    assert stages, f"{path.name}: no FROM"
    return Dockerfile(global_args, stages)


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    """The environment the ENV instructions set (both `K=v ...` and the legacy `K value`)."""
    return {k: v for ins in instructions if ins.cmd == "ENV" for k, v in extract_key_values(False, {}, {}, ins.args)}


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
