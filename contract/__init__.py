"""The artifact contract every step keeps: manifests, record format, versions and leases (see docs/architecture.md)."""
