output "bucket" {
  description = "The pipeline-root bucket's name."
  value       = google_storage_bucket.pipeline_root.name
}

output "pipeline_root" {
  description = "For `maxpipe submit --pipeline-root`."
  value       = "gs://${google_storage_bucket.pipeline_root.name}/runs"
}

output "dataflow_temp_location" {
  description = "For prep on Dataflow: --temp_location (under a prefix the lifecycle rule cleans)."
  value       = "gs://${google_storage_bucket.pipeline_root.name}/tmp"
}

output "image_prefix" {
  description = "Prefix of the image names: <image_prefix>/maxpipe-{cpu,dataflow,gpu,tpu}:<tag>."
  value       = "${google_artifact_registry_repository.images.location}-docker.pkg.dev/${var.project}/${google_artifact_registry_repository.images.repository_id}"
}

output "service_account_email" {
  description = "For `maxpipe submit --service-account` and Dataflow's --service_account_email."
  value       = google_service_account.pipelines.email
}
