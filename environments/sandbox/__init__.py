"""Docker sandboxes: one hardened container per episode, labelled with the run id."""
