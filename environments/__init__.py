"""Environments: Docker sandboxes and the gymnasium environments that act in them."""
