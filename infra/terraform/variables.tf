variable "project" {
  description = "Google Cloud project ID to set up (it must exist and have billing enabled)."
  type        = string
}

variable "region" {
  description = "Region of the bucket, the Artifact Registry repository, Vertex AI pipeline runs and Dataflow jobs (keep them together)."
  type        = string
  default     = "us-central1"
}

variable "bucket_name" {
  description = "Globally unique name of the pipeline-root bucket; \"\" = \"<project>-maxpipe\"."
  type        = string
  default     = ""

  validation {
    condition     = var.bucket_name == "" || can(regex("^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name: 3-63 characters, lowercase letters, digits, '-', '_' and '.', starting and ending with a letter or digit."
  }
}

variable "repo_name" {
  description = "Artifact Registry Docker repository for the maxpipe images."
  type        = string
  default     = "maxpipe"
}

variable "service_account_id" {
  description = "Account ID (the part before @) of the service account pipeline runs use."
  type        = string
  default     = "maxpipe-pipelines"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.service_account_id))
    error_message = "service_account_id: 6-30 characters, lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "bucket_versioning" {
  description = "Keep noncurrent object versions (deleted after noncurrent_retention_days). Checkpoints are large: off by default."
  type        = bool
  default     = false
}

variable "noncurrent_retention_days" {
  description = "With versioning on, days a noncurrent object version is kept."
  type        = number
  default     = 30
}

variable "temp_prefixes" {
  description = "Object name prefixes of temporary data (Dataflow temp/staging files) deleted after temp_retention_days."
  type        = list(string)
  default     = ["tmp/", "temp/"]
}

variable "temp_retention_days" {
  description = "Age in days after which objects under temp_prefixes are deleted."
  type        = number
  default     = 7
}

variable "pipeline_submitters" {
  description = "Principals (\"user:alice@example.com\", \"group:ml@example.com\") allowed to submit and schedule runs as the pipeline service account: granted roles/aiplatform.user on the project and roles/iam.serviceAccountUser on that account only."
  type        = list(string)
  default     = []
}

variable "image_pushers" {
  description = "Principals allowed to push images to the repository (roles/artifactregistry.writer on it only), e.g. the service account your Cloud Build builds run as."
  type        = list(string)
  default     = []
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket with everything in it."
  type        = bool
  default     = false
}

variable "labels" {
  description = "Labels set on the bucket and the repository."
  type        = map(string)
  default     = { app = "maxpipe" }
}
