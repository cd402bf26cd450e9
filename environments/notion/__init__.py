"""The notion environment: a mock Notion workspace (pages, nested blocks, typed databases) with seeded task families."""
