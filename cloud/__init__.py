"""Clients of the cloud services maxpipe runs on (Vertex AI); below components and pipelines, above configs and contract."""
