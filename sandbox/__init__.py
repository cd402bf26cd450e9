"""The Docker sandbox, the one part that talks to the Docker daemon: one hardened container per episode, labelled with
the run id, its shell sessions, the warm pool, the policy stop, the images, and reaping what a dead run left."""
