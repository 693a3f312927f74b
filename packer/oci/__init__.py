"""Reproducible OCI image layers, image layout, base append and Dockerfile."""
