"""The slack environment: a mock Slack workspace (channels, threads, reactions, search) with seeded task families."""
