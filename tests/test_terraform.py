"""Static checks of infra/terraform/ (and infra/README.md's walk-through): the project set-up with least privilege.

No terraform binary and no cloud here: the files are read by python-hcl2 and checked for what they must do; what
only `terraform apply` shows is listed in infra/README.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hcl2
import pytest

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
TERRAFORM = INFRA / "terraform"

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------
# Terraform, as python-hcl2 reads it: an attribute is a literal (a quoted string keeps its quotes), a
# list or dict of them, or an expression `${...}`; blocks are gathered below with their labels.

HCL_OPTIONS = hcl2.SerializationOptions(with_comments=False)


@dataclass
class Block:
    type: str
    labels: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)  # name -> python-hcl2's value
    blocks: list["Block"] = field(default_factory=list)

    def children(self, type_: str) -> list["Block"]:
        return [b for b in self.blocks if b.type == type_]


def _is_block(value: Any) -> bool:
    """A block body (python-hcl2 marks it), or a label leading to one."""
    return isinstance(value, dict) and (value.get("__is_block__") is True or (
        len(value) == 1 and _is_block(next(iter(value.values())))))


def _blocks(type_: str, labels: list[str], value: dict) -> list[Block]:
    if value.get("__is_block__") is True:
        attrs, blocks = _body(value)
        return [Block(type_, labels, attrs, blocks)]
    return [b for label, inner in value.items() for b in _blocks(type_, labels + [label.strip('"')], inner)]


def _body(body: dict) -> tuple[dict[str, Any], list[Block]]:
    attrs, blocks = {}, []
    for key, value in body.items():
        if key.startswith("__"):
            continue
        if isinstance(value, list) and value and all(_is_block(v) for v in value):
            blocks += [b for v in value for b in _blocks(key, [], v)]
        else:
            attrs[key] = value
    return attrs, blocks


def parse_hcl(text: str) -> list[Block]:
    attrs, blocks = _body(hcl2.loads(text, serialization_options=HCL_OPTIONS))
    assert not attrs, f"top-level attributes are not valid HCL configuration: {list(attrs)}"
    return blocks


def expr(value: Any) -> Any:
    """An expression attribute's source (`${var.x}` -> `var.x`); anything else unchanged."""
    return value[2:-1] if isinstance(value, str) and value.startswith("${") and value.endswith("}") else value


def literal(value: Any):
    """The value of a literal: a string without interpolation, a number, a bool, or a list of those; else None."""
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return None if "${" in value or "%{" in value else re.sub(r"\\(.)", r"\1", value[1:-1])
    if isinstance(value, list):
        values = [literal(v) for v in value]
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


def resolve(tf: dict, value: Any):
    """A literal, or `var.X` (its default), `local.X`, `toset(...)` of those."""
    code = expr(value)
    if isinstance(code, str):
        m = re.fullmatch(r"toset\((.*)\)", code, re.S)
        if m:
            return resolve(tf, "${" + m.group(1) + "}")
        m = re.fullmatch(r"local\.(\w+)", code)
        if m:
            return resolve(tf, tf["locals"][m.group(1)])
        m = re.fullmatch(r"var\.(\w+)", code)
        if m:
            return resolve(tf, tf["variables"][m.group(1)].attrs["default"])
    return literal(value)


def grants(tf: dict, resource_type: str) -> list[tuple[str, str, Block]]:
    """(role, member expression, resource) for each grant a resource of this type makes; a
    `for_each` over a list expands `each.value` in role or member."""
    out = []
    for (rtype, _), res in tf["resources"].items():
        if rtype != resource_type:
            continue
        each = resolve(tf, res.attrs["for_each"]) if "for_each" in res.attrs else None
        assert "for_each" not in res.attrs or isinstance(each, list), f"{rtype}: cannot read for_each"
        role, member = expr(res.attrs["role"]), expr(res.attrs["member"])
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


def test_hcl_reading_rejects_unbalanced_input_and_reads_literals():
    with pytest.raises(Exception, match="Unexpected"):
        parse_hcl('resource "a" "b" {\n  x = [1, 2\n}\n')
    with pytest.raises(Exception, match="Unexpected"):
        parse_hcl('x = "unterminated\n')
    blocks = parse_hcl('locals {\n  a = "${var.x}-{y}"  # c\n  b = ["p", "q"]\n  c = <<EOT\n}{\nEOT\n}\n')
    assert literal(blocks[0].attrs["b"]) == ["p", "q"] and literal(blocks[0].attrs["a"]) is None
    (resource,) = parse_hcl('resource "t" "n" {\n  x = var.y\n  inner {\n    z = true\n  }\n}\n')
    assert (resource.type, resource.labels, expr(resource.attrs["x"])) == ("resource", ["t", "n"], "var.y")
    assert literal(resource.children("inner")[0].attrs["z"]) is True


def test_terraform_versions_and_variables(tf):
    (terraform,) = [b for b in tf["blocks"] if b.type == "terraform"]
    (providers,) = terraform.children("required_providers")
    assert literal(providers.attrs["google"]["source"]) == "hashicorp/google"
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
    assert expr(bucket.attrs["location"]) == "var.region"
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
    assert expr(repo.attrs["repository_id"]) == "var.repo_name"
    assert expr(repo.attrs["location"]) == "var.region"
    sa = tf["resources"][("google_service_account", "pipelines")]
    assert expr(sa.attrs["account_id"]) == "var.service_account_id"
    assert expr(tf["locals"]["sa_member"]) == '"serviceAccount:${google_service_account.pipelines.email}"'


def test_terraform_service_account_has_exactly_the_least_privilege_grants(tf):
    project = {role for role, member, _ in grants(tf, "google_project_iam_member") if member == SA_MEMBER}
    assert project == {"roles/aiplatform.user", "roles/dataflow.developer", "roles/dataflow.worker",
                       "roles/logging.logWriter"}
    bucket = [(role, res) for role, member, res in grants(tf, "google_storage_bucket_iam_member") if member == SA_MEMBER]
    assert {role for role, _ in bucket} == {"roles/storage.objectAdmin", "roles/storage.legacyBucketReader"}
    for _, res in bucket:
        assert expr(res.attrs["bucket"]) == "google_storage_bucket.pipeline_root.name"
    repo = [(role, res) for role, member, res in grants(tf, "google_artifact_registry_repository_iam_member")
            if member == SA_MEMBER]
    assert [role for role, _ in repo] == ["roles/artifactregistry.reader"]
    assert "google_artifact_registry_repository.images" in repo[0][1].attrs["repository"]
    act_as = [(role, res) for role, member, res in grants(tf, "google_service_account_iam_member") if member == SA_MEMBER]
    assert [role for role, _ in act_as] == ["roles/iam.serviceAccountUser"]
    assert expr(act_as[0][1].attrs["service_account_id"]) == "google_service_account.pipelines.name"


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
    assert expr(outputs["service_account_email"].attrs["value"]) == "google_service_account.pipelines.email"
    prefix = outputs["image_prefix"].attrs["value"]
    assert "-docker.pkg.dev/${var.project}/" in prefix and "google_artifact_registry_repository.images" in prefix
    assert outputs["pipeline_root"].attrs["value"].startswith('"gs://${google_storage_bucket.pipeline_root.name}/')


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
