terraform {
  required_version = ">= 1.5"

  required_providers {
    google = {
      source = "hashicorp/google"
      # Only long-stable arguments are used (6.x and 7.x both accept this configuration).
      version = ">= 6.0, < 8.0"
    }
  }
}
