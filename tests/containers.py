"""What the Docker tests ask the daemon about a run: its containers, and the tag an environment's image has now.
Test-only: sandforge itself lists a run's containers to remove them (sandbox/lifecycle.py) and builds images when it
needs them (sandbox/images.py ``build_images``)."""

from __future__ import annotations

from pathlib import Path

from sandforge.sandbox.daemon import DockerClient, docker_client
from sandforge.sandbox.images import BASE_TAG, ImageError, env_image_tag, image_id, image_name
from sandforge.sandbox.labels import LABEL_RUN


def list_run_containers(run_id: str, client: DockerClient | None = None) -> list[str]:
    """Ids of every container (running or not) labelled with this run."""
    found = (client or docker_client()).containers.list(all=True, sparse=True, filters={"label": f"{LABEL_RUN}={run_id}"})
    return [c.id for c in found]


def image_for(env_name: str, client: DockerClient | None = None, base_image: str | None = None,
              envs_dir: Path | None = None) -> str:
    """The tag the current sources of ``env_name``'s image produce; raises ImageError if that image was not built."""
    env_name = image_name(env_name, envs_dir)
    client = client or docker_client()
    base = base_image if base_image and image_id(client, base_image) else BASE_TAG
    missing = ImageError(f"image for env '{env_name}' not built: run `sandforge images build`")
    if image_id(client, base) is None:
        raise missing
    tag = env_image_tag(env_name, base, client, envs_dir)
    if image_id(client, tag) is None:
        raise missing
    return tag
