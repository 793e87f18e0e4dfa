# What maxpipe needs in a Google Cloud project: the APIs, a bucket for the pipeline root, a Docker
# repository for the images and a least-privilege service account that pipeline runs (and the
# Dataflow workers of the prep step) act as. See infra/README.md for the whole walk-through.

provider "google" {
  project = var.project
  region  = var.region
}

locals {
  bucket_name = var.bucket_name != "" ? var.bucket_name : "${var.project}-maxpipe"
  sa_member   = "serviceAccount:${google_service_account.pipelines.email}"

  services = [
    "aiplatform.googleapis.com",           # Vertex AI Pipelines, custom jobs, ML Metadata, schedules
    "artifactregistry.googleapis.com",     # the images
    "cloudbuild.googleapis.com",           # infra/cloudbuild.yaml
    "cloudresourcemanager.googleapis.com", # project IAM (Terraform itself needs it)
    "compute.googleapis.com",              # Dataflow workers, Vertex machines
    "dataflow.googleapis.com",             # prep on Dataflow
    "iam.googleapis.com",                  # the service account
    "logging.googleapis.com",              # step and worker logs
    "storage.googleapis.com",              # the pipeline root
  ]

  # The pipeline service account's only project-wide roles. None of them touches Cloud Storage:
  # the bucket is granted on the bucket itself, below.
  pipeline_project_roles = [
    "roles/aiplatform.user",    # run pipeline jobs, custom (training) jobs, ML Metadata, schedules
    "roles/dataflow.developer", # launch and watch the prep job on Dataflow
    "roles/dataflow.worker",    # be the Dataflow workers' service account
    "roles/logging.logWriter",  # write logs
  ]
}

# ---------------------------------------------------------------------------------------------
# APIs

resource "google_project_service" "apis" {
  for_each = toset(local.services)

  project            = var.project
  service            = each.value
  disable_on_destroy = false # destroying this configuration must not switch off a project's APIs
}

# ---------------------------------------------------------------------------------------------
# Pipeline root: KFP run data, the artifact store, lineage, Dataflow temp files

resource "google_storage_bucket" "pipeline_root" {
  project                     = var.project
  name                        = local.bucket_name
  location                    = var.region
  storage_class               = "STANDARD"
  uniform_bucket_level_access = true       # IAM only, no object ACLs
  public_access_prevention    = "enforced" # never public, whatever a grant says
  force_destroy               = var.force_destroy
  labels                      = var.labels

  versioning {
    enabled = var.bucket_versioning
  }

  # Dataflow temp and staging files (--temp_location=gs://BUCKET/tmp) are not kept.
  lifecycle_rule {
    condition {
      age            = var.temp_retention_days
      matches_prefix = var.temp_prefixes
    }
    action {
      type = "Delete"
    }
  }

  # With versioning on, noncurrent versions go after a while (checkpoints are large).
  dynamic "lifecycle_rule" {
    for_each = var.bucket_versioning ? [1] : []
    content {
      condition {
        days_since_noncurrent_time = var.noncurrent_retention_days
        with_state                 = "ARCHIVED"
      }
      action {
        type = "Delete"
      }
    }
  }

  depends_on = [google_project_service.apis]
}

# ---------------------------------------------------------------------------------------------
# Images: maxpipe-{cpu,dataflow,gpu,tpu}, pushed by infra/cloudbuild.yaml

resource "google_artifact_registry_repository" "images" {
  project       = var.project
  location      = var.region
  repository_id = var.repo_name
  format        = "DOCKER"
  description   = "maxpipe images (cpu, dataflow, gpu, tpu) built by infra/cloudbuild.yaml"
  labels        = var.labels

  depends_on = [google_project_service.apis]
}

# ---------------------------------------------------------------------------------------------
# The service account pipeline runs act as (maxpipe submit --service-account), also the one the
# prep step's Dataflow workers run as (--service_account_email).

resource "google_service_account" "pipelines" {
  project      = var.project
  account_id   = var.service_account_id
  display_name = "maxpipe pipeline runs"
  description  = "Runs maxpipe's Vertex AI pipeline jobs, their custom jobs and the Dataflow workers of prep."

  depends_on = [google_project_service.apis]
}

resource "google_project_iam_member" "pipelines" {
  for_each = toset(local.pipeline_project_roles)

  project = var.project
  role    = each.value
  member  = local.sa_member
}

# Read and write objects in the pipeline bucket, and nothing in any other bucket.
resource "google_storage_bucket_iam_member" "pipelines_objects" {
  bucket = google_storage_bucket.pipeline_root.name
  role   = "roles/storage.objectAdmin"
  member = local.sa_member
}

# storage.buckets.get (+ objects.list) on that bucket: Beam's GCS client and the Vertex AI
# pipeline-root check read the bucket's metadata, which roles/storage.objectAdmin does not grant.
resource "google_storage_bucket_iam_member" "pipelines_bucket_metadata" {
  bucket = google_storage_bucket.pipeline_root.name
  role   = "roles/storage.legacyBucketReader"
  member = local.sa_member
}

# Pull the images (Dataflow workers pull the worker image as this account; Vertex AI pulls with
# its own service agent, which reads the project's repositories already).
resource "google_artifact_registry_repository_iam_member" "pipelines_reader" {
  project    = var.project
  location   = google_artifact_registry_repository.images.location
  repository = google_artifact_registry_repository.images.name
  role       = "roles/artifactregistry.reader"
  member     = local.sa_member
}

# Vertex AI launches the pipeline's custom jobs, and prep launches its Dataflow job, as this same
# account: it must be allowed to act as itself, and as no other account.
resource "google_service_account_iam_member" "pipelines_act_as_self" {
  service_account_id = google_service_account.pipelines.name
  role               = "roles/iam.serviceAccountUser"
  member             = local.sa_member
}

# ---------------------------------------------------------------------------------------------
# Optional: the people (or CI accounts) who submit runs, and whoever pushes images.

resource "google_project_iam_member" "submitters_vertex" {
  for_each = toset(var.pipeline_submitters)

  project = var.project
  role    = "roles/aiplatform.user"
  member  = each.value
}

resource "google_service_account_iam_member" "submitters_act_as" {
  for_each = toset(var.pipeline_submitters)

  service_account_id = google_service_account.pipelines.name
  role               = "roles/iam.serviceAccountUser"
  member             = each.value
}

resource "google_artifact_registry_repository_iam_member" "pushers" {
  for_each = toset(var.image_pushers)

  project    = var.project
  location   = google_artifact_registry_repository.images.location
  repository = google_artifact_registry_repository.images.name
  role       = "roles/artifactregistry.writer"
  member     = each.value
}
