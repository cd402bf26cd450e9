"""Environments written for the ``verifiers`` library (PyPI ``verifiers`` 0.4, ``verifiers.v1``): their tasks as
sandforge tasks (tasks.py). Their episodes are run by rollout/vf_episode.py."""
